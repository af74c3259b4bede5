"""--max-prompt-tokens is the whole prompt's budget (issue 33, found on vLLM with a 2,048-token
window): the task context, the task and the stages' allowance count against it, and a rollout
renders to the same bytes in its rubric and judge calls whatever the budget."""

from __future__ import annotations

import polars as pl

from draco_cli.judge.core import score_stage
from draco_cli.llm.types import Sampling
from draco_cli.prompts.render import CHARS_PER_TOKEN, RenderOptions
from draco_cli.rubric.core import stage_requests
from tests.conftest import REPO

SAMPLE = REPO / "sample_data" / "appworld_mini"


def _frames(context: str):
    rollouts = pl.read_parquet(SAMPLE / "rollouts.parquet")
    steps = pl.read_parquet(SAMPLE / "steps.parquet")
    long = pl.col("observation") + pl.lit(" filler" * 400)   # every step long enough to cut
    return (rollouts.with_columns(task_context=pl.lit(context, pl.String)),
            steps.with_columns(observation=long))


def _prompt_tokens(req) -> int:
    return sum(len(m["content"]) for m in req.messages) // CHARS_PER_TOKEN


def test_the_budget_covers_the_whole_prompt_and_both_stages_render_alike():
    context = "Policy: confirm every change with the user before making it.\n" * 200  # ~3k
    rollouts, steps = _frames(context)
    criteria = pl.DataFrame({"group_id": rollouts["group_id"].unique().to_list()}).with_columns(
        criterion_id=pl.lit("c1"), title=pl.lit("Confirms first"),
        requirement=pl.lit("Asks before changing anything."), source=pl.lit("merge"))
    for budget in (5000, 12000):
        render = RenderOptions(max_prompt_tokens=budget)
        rubric = stage_requests(rollouts, steps, ("generate",), 8, render, Sampling())
        judge = list(next(score_stage(rollouts, steps, criteria, render=render)))
        generate = {req.key: req for _, _, _, req in rubric}
        # the steps were cut to fit the whole prompt, context included
        cut = sum("characters omitted" in req.messages[1]["content"] for req in judge)
        assert cut >= (len(judge) // 2 if budget == 5000 else 1)
        for req in judge:
            assert _prompt_tokens(req) <= budget
            assert _prompt_tokens(generate[req.key]) <= budget
            # one cached head: the rollout's text is the same bytes in both stages
            head = generate[req.key].messages[1]["content"][:generate[req.key].cache_prefix]
            assert req.messages[1]["content"].startswith(head)
