"""``verdict_rows`` keeps its citation rule: the distinct cited steps within 1..M, sorted, and
every distinct step outside counted as dropped (the rows sort first and filter only when some
step is out of range)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from draco_cli.judge.core import ScoreAnswer, ScoreStats, VerdictItem, verdict_rows
from draco_cli.llm.types import Answer
from tests.conftest import examples


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.lists(st.integers(-3, 12), max_size=8), min_size=1, max_size=4),
       st.integers(0, 9))
def test_citations_kept_and_dropped_as_the_rule_says(cited, n_steps):
    ids = [f"c{i}" for i in range(len(cited))]
    answer = Answer(0, "ok", ScoreAnswer(verdicts=[
        VerdictItem(criterion_id=c, verdict="pass", cited_steps=steps, reason="r")
        for c, steps in zip(ids, cited)]))
    stats = ScoreStats()
    rows = verdict_rows("r1", ids, n_steps, "judge", 0, answer, stats)
    assert [r["cited_steps"] for r in rows] == \
        [sorted({s for s in steps if 1 <= s <= n_steps}) for steps in cited]
    assert stats.citations_dropped == sum(
        len(set(steps)) - len({s for s in steps if 1 <= s <= n_steps}) for steps in cited)
