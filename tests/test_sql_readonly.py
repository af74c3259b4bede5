"""draco sql is read-only by default: a query cannot write files, read files outside its
inputs, load extensions or attach databases; --allow-external lifts it. Run folders whose
path holds ``..`` or a dot-folder open in draco sql and draco report."""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest

from tests.conftest import REPO, run_draco

SAMPLE = ["--rollouts", "sample_data/appworld_mini/rollouts.parquet", "--steps",
          "sample_data/appworld_mini/steps.parquet", "--model",
          "replay/sample_data/llm_calls.sqlite"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ro") / ".hidden" / "run"
    res = run_draco("run", *SAMPLE, "-o", str(d))
    assert res.returncode == 0, res.stderr.decode()
    return d


def attacks(run, outside):
    """(query, a file it would create, if any)."""
    secret = outside / "secret.csv"
    return [
        (f"COPY (SELECT * FROM rewards) TO '{outside / 'a.csv'}'", outside / "a.csv"),
        (f"COPY (SELECT * FROM rewards) TO '{run / 'b.csv'}'", run / "b.csv"),
        (f"EXPORT DATABASE '{run / 'exported'}'", run / "exported"),
        (f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{run / 'c.csv'}'", run / "c.csv"),
        (f"PREPARE p AS COPY (SELECT 1) TO '{run / 'd.csv'}'", run / "d.csv"),
        (f"SELECT 1; COPY (SELECT 1) TO '{run / 'e.csv'}'", run / "e.csv"),
        (f"SELECT * FROM read_csv('{secret}')", None),
        ("SELECT * FROM read_csv('/etc/passwd')", None),
        (f"SELECT * FROM read_text('{run}/../../secret.csv')", None),
        (f"SELECT * FROM read_parquet('{REPO / 'sample_data' / '*' / '*.parquet'}')", None),
        ("SELECT * FROM glob('/etc/*')", None),
        (f"ATTACH '{outside / 'x.duckdb'}' AS x", outside / "x.duckdb"),
        ("ATTACH ':memory:' AS y", None),
        ("INSTALL httpfs", None),
        ("LOAD httpfs", None),
        ("SET enable_external_access = true", None),
        ("RESET lock_configuration", None),
        ("SELECT * FROM read_csv_auto('https://example.com/x.csv')", None),
    ]


def test_each_attack_is_refused_in_one_line(run):
    outside = run.parent.parent
    (outside / "secret.csv").write_text("password\nhunter2\n")
    for query, made in attacks(run, outside):
        res = run_draco("sql", run, query)
        err = res.stderr.decode()
        assert res.returncode in (1, 2), (query, res.stdout.decode())
        assert err.startswith("error: SQL:") and len(err.strip().splitlines()) == 1, (query, err)
        assert "hunter2" not in res.stdout.decode() + err
        if made is not None:
            assert not made.exists(), query
    # the refusals say how to lift them
    res = run_draco("sql", run, f"COPY (SELECT 1) TO '{run / 'z.csv'}'")
    assert b"--allow-external" in res.stderr
    # with no input, files under the current folder only
    res = run_draco("sql", "-c", "SELECT * FROM read_csv('/etc/passwd')")
    assert res.returncode == 2 and b"--allow-external" in res.stderr


def test_ordinary_queries_still_work(run):
    want = pl.read_parquet(run / "credit" / "rewards.parquet").height
    for query in ("SELECT count(*) AS n FROM rewards",
                  f"SELECT count(*) AS n FROM read_parquet('{run / 'credit' / 'rewards.parquet'}')",
                  f"SELECT count(*) AS n FROM '{run}/credit/*.parquet' WHERE false OR true "
                  "LIMIT 0",
                  "CREATE TEMP TABLE t AS SELECT * FROM rewards; SELECT count(*) AS n FROM t",
                  "EXPLAIN SELECT * FROM rewards"):
        res = run_draco("sql", run, query, "--json")
        assert res.returncode == 0, (query, res.stderr.decode())
        if query.startswith("SELECT count(*) AS n FROM rewards"):
            assert json.loads(res.stdout) == [{"n": want}]
    # the rollouts the manifest names, outside the run folder, are read too
    res = run_draco("sql", run, "SELECT count(*) AS n FROM rollouts", "--json")
    assert json.loads(res.stdout) == [{"n": 12}]


def test_allow_external_lifts_it(run, tmp_path):
    out = tmp_path / "copy.csv"
    res = run_draco("sql", "--allow-external", run,
                    f"COPY (SELECT * FROM rewards) TO '{out}'")
    assert res.returncode == 0, res.stderr.decode()
    assert out.exists()
    (tmp_path / "other.csv").write_text("a\n1\n2\n")
    res = run_draco("sql", "--allow-external", run,
                    f"SELECT count(*) AS n FROM read_csv('{tmp_path / 'other.csv'}')", "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == [{"n": 2}]


def test_dot_folders_and_dotdot_in_the_path(run, tmp_path):
    """A run folder, a folder of tables (draco ingest) and an extra table, each reached
    through a dot-folder and through "..", open in draco sql and draco report."""
    base = tmp_path / ".cache" / "x"
    (base / "sub").mkdir(parents=True)
    shutil.copytree(run, base / "run")
    (base / "run" / "audit").mkdir()
    pl.DataFrame({"a": [1, 2, 3]}).write_parquet(base / "run" / "audit" / "extra.parquet")
    ing = run_draco("ingest", "openai-jsonl", "sample_data/appworld_mini.jsonl", "--step-unit",
                    "code-block", "--code-language", "python", "--tokenizer", "approx", "-o", base / "ingested")
    assert ing.returncode == 0, ing.stderr.decode()
    for folder in (base / "run", base / "sub" / ".." / "run"):
        res = run_draco("sql", folder, "SELECT (SELECT count(*) FROM rewards) AS r, "
                        "(SELECT count(*) FROM extra) AS e", "--json")
        assert res.returncode == 0, res.stderr.decode()
        assert json.loads(res.stdout) == [{"r": 12, "e": 3}]
        rep = run_draco("report", folder, "-o", tmp_path / "r.html", "--force")
        assert rep.returncode == 0, rep.stderr.decode()
    for folder in (base / "ingested", base / "sub" / ".." / "ingested"):
        res = run_draco("sql", folder, "SELECT count(*) AS n FROM rollouts", "--json")
        assert res.returncode == 0, res.stderr.decode()
        assert json.loads(res.stdout)[0]["n"] > 0
    # relative, from inside the dot-folder
    res = run_draco("sql", "../run", "SELECT count(*) AS n FROM extra", "--json",
                    cwd=base / "sub")
    assert res.returncode == 0 and json.loads(res.stdout) == [{"n": 3}], res.stderr.decode()
