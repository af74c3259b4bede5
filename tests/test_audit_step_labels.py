"""``draco audit step-labels`` on the shipped hotpotqa data (AgentProcessBench): every figure
against a computation written here from SPEC §4 (plain loops and fractions, none of the
library's helpers), the perfect and the random judge, a draco run through the protocol server,
and bad labels."""

from __future__ import annotations

import json
import statistics
from fractions import Fraction

import polars as pl
import pytest

from draco_cli.audit.stage import audit_step_labels
from draco_cli.errors import InputError
from tests.conftest import APB, APB_HOTPOT, APB_JUDGES, run_draco
from tests.llm_server import FakeLLMServer
from tests.test_rubric_judge import scripted


@pytest.fixture(scope="module")
def hotpot(tmp_path_factory):
    d = tmp_path_factory.mktemp("hotpot")
    assert run_draco("ingest", "agentprocessbench", str(APB_HOTPOT), "-o", str(d)).returncode == 0
    return d


def judge_files():
    return [str(APB / f"hotpotqa__blind_{j}.jsonl") for j in APB_JUDGES]


# --- the reference computation (SPEC §3.5, §3.6, §4) ------------------------------------------


def outcome_advantages(rollouts):
    by_group = {}
    for rid, gid, o in rollouts.select("rollout_id", "group_id", "outcome").iter_rows():
        by_group.setdefault(gid, []).append((rid, o))
    adv = {}
    for members in by_group.values():
        rs = [o for _, o in members]
        flat = len(rs) < 2 or max(rs) == min(rs)
        for rid, o in members:
            adv[rid] = 0.0 if flat else (o - statistics.mean(rs)) / (statistics.stdev(rs) + 1e-6)
    return adv


def reference_credit(n, judged, A):
    """(Q per step or None, step totals) for one rollout: judged[j] = +1 pass, -1 fail, else
    uncited."""
    cited = [j for j, v in enumerate(judged) if v in (1, -1)]
    if not cited:
        return [None] * len(n), [nj * A for nj in n]
    qc = {j: Fraction(1 if judged[j] == 1 else 0) for j in cited}
    qbar = sum(qc.values()) / len(cited)
    Q = [qc.get(j, qbar) for j in range(len(n))]
    w = [q if A >= 0 else 1 - q for q in Q]
    if sum(w) == 0:
        w = [Fraction(1, len(n))] * len(n)
    N = sum(n)
    return Q, [A * N * float(wj / sum(w)) for wj in w]


def reference_figures(per_rollout):
    """per_rollout: list of (A, n list, h list, Q list, t list)."""
    good = [q for A, n, h, Q, t in per_rollout for hj, q in zip(h, Q) if hj == 1 and q is not None]
    bad = [q for A, n, h, Q, t in per_rollout for hj, q in zip(h, Q) if hj == -1 and q is not None]
    # qualities equal up to rounding (1/3 reached two ways) are ties
    wins = sum((a - b > 1e-12) + 0.5 * (abs(a - b) <= 1e-12) for a in good for b in bad)
    out = {"auroc_quality": wins / (len(good) * len(bad))}
    num = den = 0.0
    for A, n, h, Q, t in per_rollout:
        if A < 0:
            num += sum(abs(x) for x, hj in zip(t, h) if hj == -1)
            den += sum(abs(x) for x in t)
    out["bad_mass"] = num / den
    num = den = 0.0
    for A, n, h, Q, t in per_rollout:
        if A > 0:
            num += sum(x for x, hj in zip(t, h) if hj == 1)
            den += sum(t)
    out["good_mass"] = num / den
    hits = []
    for A, n, h, Q, t in per_rollout:
        if -1 in h and 1 in h and all(q is not None for q in Q):
            low = min(Q)
            ties = [hj for hj, q in zip(h, Q) if abs(q - low) <= 1e-12]
            hits.append(ties.count(-1) / len(ties))
    out["worst_step_hit"] = sum(hits) / len(hits)
    return out


def per_rollout_lists(hotpot, labels_of):
    r = pl.read_parquet(hotpot / "rollouts.parquet")
    s = pl.read_parquet(hotpot / "steps.parquet").sort("rollout_id", "step")
    human = {(a, b): c for a, b, c in pl.read_parquet(hotpot / "step_labels.parquet")
             .select("rollout_id", "step", "label").iter_rows()}
    adv = outcome_advantages(r)
    steps = {}
    for rid, step, n in s.select("rollout_id", "step", "n_tokens").iter_rows():
        steps.setdefault(rid, []).append((step, n))
    out = []
    for rid, st in steps.items():
        n = [x for _, x in st]
        h = [human.get((rid, k)) for k, _ in st]
        Q, t = reference_credit(n, [labels_of.get((rid, k)) for k, _ in st], adv[rid])
        out.append((adv[rid], n, h, Q, t))
    return out


def judge_labels(path, hotpot):
    """A judge's results file keyed by message index, mapped here from the raw log."""
    raw = {f"{x['data_source']}:{x['query_index']}:{x['sample_index']}": x
           for x in map(json.loads, APB_HOTPOT.open())}
    out = {}
    for line in open(path):
        j = json.loads(line)
        rid = j["record_id"]
        assistant = [i for i, m in enumerate(raw[rid]["messages"]) if m["role"] == "assistant"]
        for key, v in j["step_labels"].items():
            out[(rid, assistant.index(int(key)) + 1)] = v
    return out


def figures_of(df, source):
    return {f: v for _, f, v in df.filter(pl.col("source") == source)
            .select("source", "figure", "value").iter_rows()}


# --- tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def audit(hotpot, tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    return audit_step_labels(hotpot, judge_files(), out=out, seed=7, draws=300).figures


def test_human_labels_as_a_perfect_judge(audit, hotpot):
    human = {(a, b): c for a, b, c in pl.read_parquet(hotpot / "step_labels.parquet")
             .select("rollout_id", "step", "label").iter_rows()}
    got = figures_of(audit, "labels:human")
    want = reference_figures(per_rollout_lists(hotpot, human))
    assert got["auroc_quality"] == 1.0 and got["worst_step_hit"] == 1.0
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-12), k
    # full mass where the labels leave no room: losers whose every step is −1 or +1 with a −1
    rows = [x for x in per_rollout_lists(hotpot, human)
            if x[0] < 0 and -1 in x[2] and set(x[2]) <= {-1, 1}]
    assert rows and sum(abs(t) for A, n, h, Q, tt in rows for t, hj in zip(tt, h) if hj == -1) \
        == pytest.approx(sum(abs(t) for A, n, h, Q, tt in rows for t in tt), rel=1e-12)
    # and no credit source beats it
    for f in ("auroc_quality", "bad_mass", "worst_step_hit"):
        assert got[f] >= audit.filter(pl.col("figure") == f)["value"].max() - 1e-12


@pytest.mark.parametrize("judge", APB_JUDGES)
def test_llm_judges_figures_equal_the_reference(audit, hotpot, judge):
    got = figures_of(audit, f"labels:{judge}")
    want = reference_figures(per_rollout_lists(
        hotpot, judge_labels(APB / f"hotpotqa__blind_{judge}.jsonl", hotpot)))
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-12), (judge, k)
    assert 0.6 < got["auroc_quality"] < 0.9  # measured 0.71–0.74 (docs/audits.md)


def test_uniform_and_intervals(audit, hotpot):
    u = audit.filter(pl.col("source") == "uniform")
    assert figures_of(audit, "uniform")["auroc_quality"] == 0.5
    s = pl.read_parquet(hotpot / "steps.parquet").join(
        pl.read_parquet(hotpot / "step_labels.parquet"), on=["rollout_id", "step"])
    adv = outcome_advantages(pl.read_parquet(hotpot / "rollouts.parquet"))
    losers = s.filter(pl.col("rollout_id").is_in([r for r, a in adv.items() if a < 0]))
    share = losers.filter(pl.col("label") == -1)["n_tokens"].sum() / losers["n_tokens"].sum()
    assert u.filter(pl.col("figure") == "bad_mass")["uniform"][0] == pytest.approx(share)
    ok = audit.filter(pl.col("value").is_not_null())
    assert (ok["ci_low"] <= ok["value"] + 1e-12).all() and (ok["value"] <= ok["ci_high"] + 1e-12).all()
    assert set(audit["zero_advantage_rollouts"]) == {120}  # 24 one-outcome groups of 5
    # n of a mass figure counts rollouts (docs/audits.md), not their steps
    n = {f: v for f, v in u.select("figure", "n").iter_rows()}
    assert n["bad_mass"] == sum(a < 0 for a in adv.values())
    assert n["good_mass"] == sum(a > 0 for a in adv.values())
    assert n["bad_mass"] + n["good_mass"] + 120 == len(adv)


def test_random_citation_stays_near_chance_and_is_seeded(hotpot, tmp_path):
    values = []
    for seed in range(6):
        f = audit_step_labels(hotpot, [], out=tmp_path / str(seed), seed=seed, draws=50).figures
        values.append(figures_of(f, "random_citation")["auroc_quality"])
    assert all(0.4 < v < 0.6 for v in values) and abs(statistics.mean(values) - 0.5) < 0.04
    again = audit_step_labels(hotpot, [], out=tmp_path / "again", seed=5, draws=50).figures
    assert figures_of(again, "random_citation")["auroc_quality"] == values[5]


def test_cli_formats_and_named_labeler(hotpot, tmp_path):
    p = run_draco("audit", "step-labels", "--rollouts", str(hotpot), "--labels",
                  f"gpt={judge_files()[0]}", "--bootstrap", "20", "--format", "json",
                  "-o", str(tmp_path))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert {r["source"] for r in doc["figures"]} == {"uniform", "labels:human", "labels:gpt",
                                                    "random_citation"}
    p = run_draco("audit", "step-labels", "--rollouts", str(hotpot), "--bootstrap", "20",
                  "--format", "csv", "-o", str(tmp_path), "--force")
    assert p.stdout.decode().splitlines()[0].startswith("source,figure,value,ci_low")


def _labels_file(tmp_path, rows):
    path = tmp_path / "lab.parquet"
    pl.DataFrame(rows, orient="row", schema={"rollout_id": pl.String, "step": pl.Int32,
                                             "label": pl.Int32, "labeler": pl.String}
                 ).write_parquet(path)
    return path


@pytest.mark.parametrize("rows, words, field", [
    ([("searchR1_hotpotqa:0:0", 9, 1, "j")], "which has 4 steps", "step"),
    ([("nope:1:2", 1, 1, "j")], "unknown rollout 'nope:1:2'", "rollout_id"),
    ([("searchR1_hotpotqa:0:0", 1, 2, "j")], "label 2 is not one of", "label"),
    ([("searchR1_hotpotqa:0:0", 1, 1, "j"), ("searchR1_hotpotqa:0:0", 1, -1, "j")],
     "second label from 'j' for step 1", "step"),
])
def test_bad_labels_name_file_row_and_field(hotpot, tmp_path, rows, words, field):
    path = _labels_file(tmp_path, rows)
    with pytest.raises(InputError) as e:
        audit_step_labels(hotpot, [str(path)], out=tmp_path / "o", draws=5)
    msg = str(e.value)
    assert str(path) in msg and f"row {len(rows)}" in msg and f"field '{field}'" in msg \
        and words in msg, msg
    p = run_draco("audit", "step-labels", "--rollouts", str(hotpot), "--labels", str(path),
                  "-o", str(tmp_path / "c"))
    assert p.returncode == 1 and len(p.stderr.decode().strip().splitlines()) == 1


def test_bad_judge_file_names_line_and_key(hotpot, tmp_path):
    lines = open(judge_files()[0]).read().splitlines()
    bad = json.loads(lines[1])
    bad["step_labels"]["3"] = 1  # a tool message
    path = tmp_path / "judge.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(bad)]) + "\n")
    with pytest.raises(InputError) as e:
        audit_step_labels(hotpot, [str(path)], out=tmp_path / "o", draws=5)
    assert "line 2" in str(e.value) and "step_labels['3']" in str(e.value)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-steplabels-000000000")
    s = FakeLLMServer(answer=scripted).start()
    yield s
    s.stop()


def test_rubric_run_on_hotpotqa_groups_then_the_audit(hotpot, server, tmp_path):
    # ten groups of five keep it quick; the run's rollouts are the audit's
    groups = sorted(pl.read_parquet(hotpot / "rollouts.parquet")["group_id"].unique())[:10]
    d = tmp_path / "data"
    d.mkdir()
    r = pl.read_parquet(hotpot / "rollouts.parquet").filter(pl.col("group_id").is_in(groups))
    r.write_parquet(d / "rollouts.parquet")
    for name in ("steps", "step_labels"):
        pl.read_parquet(hotpot / f"{name}.parquet").filter(
            pl.col("rollout_id").is_in(r["rollout_id"].implode())).write_parquet(
            d / f"{name}.parquet")
    p = run_draco("run", "--rollouts", str(d / "rollouts.parquet"), "--steps",
                  str(d / "steps.parquet"), "--model", "openai/m", "--base-url",
                  server.url + "/v1", "-o", str(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    p = run_draco("audit", "step-labels", "--rollouts", str(d), "--run", str(run),
                  "--bootstrap", "50", "--format", "json")
    assert p.returncode == 0, p.stderr
    fig = pl.DataFrame(json.loads(p.stdout)["figures"])
    assert (run / "audit" / "step_label_audit.parquet").is_file()
    assert {"run", "uniform", "labels:human", "random_citation"} <= set(fig["source"])
    # the run's own figures, from its step_credit and rewards, by the reference computation
    sc = pl.read_parquet(run / "credit" / "step_credit.parquet").sort("rollout_id", "step")
    adv = dict(pl.read_parquet(run / "credit" / "rewards.parquet")
               .select("rollout_id", "advantage").iter_rows())
    human = {(a, b): c for a, b, c in pl.read_parquet(d / "step_labels.parquet")
             .select("rollout_id", "step", "label").iter_rows()}
    per = {}
    for rid, step, n, q, t in sc.select("rollout_id", "step", "n_tokens", "quality",
                                        "total").iter_rows():
        per.setdefault(rid, []).append((n, human.get((rid, step)), q, t))
    rows = [(adv[rid], [x[0] for x in v], [x[1] for x in v], [x[2] for x in v],
             [x[3] for x in v]) for rid, v in per.items()]
    want = reference_figures(rows)
    # the table at full precision (the printed figures are rounded)
    table = pl.read_parquet(run / "audit" / "step_label_audit.parquet")
    got = figures_of(table, "run")
    for k in ("auroc_quality", "bad_mass", "good_mass"):
        assert got[k] == pytest.approx(want[k], abs=1e-9), k
    # the random control cites as many steps as the run's retained verdicts do: a rollout has
    # a quality under it exactly where the run cited something (draco run keeps its verdicts
    # unfiltered, retained null: the audit filters them as the credit stage did)
    n = {(a, b): c for a, b, c in table.select("source", "figure", "n").iter_rows()}
    assert n[("random_citation", "auroc_quality")] == n[("run", "auroc_quality")] > 0
    assert pl.read_parquet(run / "judge" / "verdicts.parquet")["retained"].null_count() > 0
    # the report shows the audit's table
    p = run_draco("report", str(run), "-o", str(tmp_path / "report.html"))
    assert p.returncode == 0, p.stderr
    page = (tmp_path / "report.html").read_text()
    assert "Where credit lands" in page and "labels:human" in page


def test_bad_input_is_named_before_an_existing_output(hotpot, tmp_path):
    audit_step_labels(hotpot, [], out=tmp_path, draws=5)
    missing = tmp_path / "missing.jsonl"
    p = run_draco("audit", "step-labels", "--rollouts", str(hotpot), "--labels", str(missing),
                  "-o", str(tmp_path))
    assert p.returncode == 1 and p.stderr.decode().strip() == f"error: {missing}: no such file"
