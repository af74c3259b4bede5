"""The one answered figure: its words, its rounding, the requests it counts, older manifests."""

from draco_cli.llm.answered import Answered, money
from draco_cli.llm.types import PhaseStats
from draco_cli.run.folder import StageHealth
from draco_cli.run.health import stage_figure


def test_the_figure_counts_reused_answers_so_a_rerun_says_the_same():
    first = Answered.of([PhaseStats(answered=20, unanswered=4)])
    # the rerun: 20 answers from the call log, 4 asked again and answered
    rerun = Answered.of([PhaseStats(cached=20, answered=4)])
    assert str(first) == "answered 20 of 24 requests (83%)"
    assert str(rerun) == "answered 24 of 24 requests (100%)"
    assert first.requests == rerun.requests == 24
    # not asked for the budget: still a request the stage needed
    assert str(Answered.of([PhaseStats(answered=3, skipped=1),
                            PhaseStats(cached=2, unanswered=2)])) == \
        "answered 5 of 8 requests (62%)"


def test_the_percent_rounds_down_never_up_to_a_threshold_or_to_all():
    assert Answered(899, 1000).percent == "89%" and Answered(999, 1000).percent == "99%"
    assert Answered(29, 100).percent == "29%"   # no float floor error
    assert Answered(0, 0).share == 1.0 and Answered(0, 0).percent == "100%"


def test_unpriced_is_said_never_zero_dollars():
    assert money(None) == "unpriced" and money(0.0, priced=False) == "unpriced"
    assert money(0.0) == "$0.0000" and money(1.5, places=2) == "$1.50"


def test_older_manifests_that_said_calls_read_as_requests():
    old = {"calls": 40, "answered": 16, "answered_share": 0.4, "reasons": {}, "ok": False}
    assert StageHealth.model_validate(old).requests == 40
    assert str(stage_figure(old)) == "answered 16 of 40 requests (40%)"
    assert stage_figure({"requests": 2, "answered": 2, "reasons": {}}) == Answered(2, 2)
