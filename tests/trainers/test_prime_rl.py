"""draco's prime-rl Algorithm against the contract stand-in of prime-rl at the recorded commit
(tests/trainers/prime_rl_contract.py), on verifiers 0.4.0's own episodes: registered in the
closed list, built by ``build_algorithm``, set up, fed through ``finalize_group``; every value
on its sampled token, a short group judged as its survivors, the length rule enforced."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("verifiers.v1")

from draco_cli.errors import UsageError  # noqa: E402
from draco_cli.trainers.prime_rl import algorithm_class, register  # noqa: E402
from draco_cli.trainers.verifiers import trace_tokens  # noqa: E402
from tests.llm_server import FakeLLMServer  # noqa: E402
from tests.test_rubric_judge import scripted  # noqa: E402
from tests.trainers import prime_rl_contract as contract  # noqa: E402
from tests.trainers.verifiers_traces import make_group  # noqa: E402


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-api-0000000000000")
    s = FakeLLMServer(answer=scripted, latency=0.01).start()
    yield s
    s.stop()


def decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_registered_algorithm_fills_every_trace_through_prime_rls_own_path(
        server, tmp_path, monkeypatch):
    algo = contract.install(monkeypatch)
    cls = algorithm_class("openai/m", base_url=server.url + "/v1", group_size=4, decode=decode,
                          call_log=tmp_path / "calls.sqlite", steps_dir=tmp_path / "steps")
    register(cls)
    instance = algo.build_algorithm(contract.AlgoConfig("grpo"), None)
    assert type(instance) is cls and isinstance(instance, contract.Algorithm)
    rng = np.random.default_rng(11)
    groups = [make_group(rng, task, 4) for task in range(2)] + [
        make_group(rng, 5, 4, errored=1)]

    async def run() -> None:
        with pytest.raises(UsageError, match="before setup"):
            await instance.score_group(groups[0])
        await instance.setup()
        try:
            for g in groups:
                rng.shuffle(g)
                await instance.finalize_group(g)
        finally:
            await instance.draco.scorer.__aexit__(None, None, None)

    asyncio.run(run())
    rows = {k: v for r in instance.draco.results for k, v in r.rows.items()}
    assert instance.draco.short == 1 and len(rows) == 11
    for g in groups:
        for ep in g:
            t = ep.traces[0]
            if not t.ok:      # prime-rl drops errored traces: never scored, unassigned
                assert all(n.advantages is None for n in t.nodes)
                continue
            tt = trace_tokens(t)
            before = sum(len(n.token_ids) for n in t.nodes[:tt.first])
            want = [0.0] * before + rows[t.id].values.astype(float).tolist()
            assert t.branches[0].advantages == pytest.approx(want, abs=0)
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["g0", "g1", "g5"]
    assert (tmp_path / "steps" / "g0" / "step-000003" / "credit" /
            "token_advantages.parquet").is_file()


def test_register_refuses_what_prime_rl_would_not_build(monkeypatch):
    algo = contract.install(monkeypatch)
    cls = algorithm_class("openai/m", group_size=4, decode=decode, call_log="x.sqlite")
    with pytest.raises(UsageError, match="no algorithm type 'draco'"):
        register(cls, "draco")
    with pytest.raises(UsageError, match="ref_kl loss"):
        register(cls, "opd")
    assert algo.ALGORITHM_CLASSES["grpo"] is contract.GRPOAlgorithm


def test_contract_length_rule_matches_draco_assign():
    from draco_cli.trainers.loader import AlignmentError
    from draco_cli.trainers.verifiers import assign_compact

    rng = np.random.default_rng(12)
    trace = make_group(rng, 1, 1)[0].traces[0]
    n = trace_tokens(trace).n_sampled
    for values in ([0.0] * (n - 1), [0.0] * (n + 1)):
        with pytest.raises(ValueError, match="must align"):
            contract.assign_advantages(trace, values)
        with pytest.raises(AlignmentError, match="sampled tokens"):
            assign_compact(trace, values)
    values = list(np.linspace(-1, 1, n))
    contract.assign_advantages(trace, values)
    theirs = [n.advantages for n in trace.nodes]
    for node in trace.nodes:
        node.advantages = None
    assign_compact(trace, values)
    assert [n.advantages for n in trace.nodes] == theirs
