"""The decode node's choice of a prefill node, without a network: load reports as health-check metadata,
and the least-loaded and round-robin policies over ``LoadView``s."""

from __future__ import annotations

import collections

import pytest

from kpool_pd.decode_worker.prefill_choice import LoadView, PrefillChooser, PrefillPolicy
from kpool_pd.runtime.load_report import LOAD_METADATA_KEY, NodeLoad


def load(queued: int = 0, free: int = 100, steps: int = 0, block_tokens: int = 64) -> NodeLoad:
    return NodeLoad(queued_prompt_tokens=queued, free_blocks=free, block_tokens=block_tokens, steps_in_flight=steps)


def reported(*loads: NodeLoad | None) -> list[LoadView]:
    views = []
    for report in loads:
        view = LoadView()
        view.reported(report, covers=0)
        views.append(view)
    return views


def test_a_load_report_survives_metadata_and_ignores_names_it_does_not_know():
    sent = NodeLoad(queued_prompt_tokens=1234, free_blocks=17, block_tokens=256, steps_in_flight=1, grants_held=3)
    ((key, text),) = sent.to_metadata()
    assert key == LOAD_METADATA_KEY
    assert NodeLoad.from_metadata([("other", "x"), (key, text)]) == sent
    assert NodeLoad.from_metadata([(key, (text + ";newer_field=9").encode())]) == sent
    assert NodeLoad.from_metadata([("other", "x")]) is None and NodeLoad.from_metadata(None) is None


@pytest.mark.parametrize("text", ["queued_prompt_tokens=1", "queued_prompt_tokens=-1;free_blocks=1;block_tokens=1;"
                                  "steps_in_flight=0", "garbage", "free_blocks=1;block_tokens=0;queued_prompt_tokens=0;"
                                  "steps_in_flight=0"], ids=["missing", "negative", "garbage", "zero-block"])
def test_a_malformed_load_report_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="load report|block_tokens"):
        NodeLoad.from_metadata([(LOAD_METADATA_KEY, text)])


def test_least_loaded_takes_the_node_with_fewest_queued_tokens():
    views = reported(load(queued=5000), load(queued=100), load(queued=3000))
    assert PrefillChooser(PrefillPolicy.LEAST_LOADED).choose(views, 10) == 1


def test_a_burst_spreads_because_each_pick_counts_at_once():
    views = reported(load(), load(), load(), load())
    chooser = PrefillChooser(PrefillPolicy.LEAST_LOADED)
    picks = collections.Counter(chooser.choose(views, 200) for _ in range(40))
    assert picks == {0: 10, 1: 10, 2: 10, 3: 10}


def test_a_long_prompt_weighs_more_than_a_short_one():
    views = reported(load(), load())
    chooser = PrefillChooser(PrefillPolicy.LEAST_LOADED)
    first = chooser.choose(views, 4000)
    others = [chooser.choose(views, 100) for _ in range(30)]  # 3,000 tokens: all on the other node
    assert set(others) == {1 - first}


def test_a_node_without_room_for_the_prompt_comes_last():
    views = reported(load(queued=0, free=2), load(queued=9000, free=100))
    chooser = PrefillChooser(PrefillPolicy.LEAST_LOADED)
    assert chooser.choose(views, 64 * 3) == 1  # 3 blocks do not fit in 2
    assert chooser.choose(views, 64) == 0
    assert chooser.choose(views, 64) == 0
    assert chooser.choose(views, 64) == 1  # its 2 free blocks are taken by the picks since its report


def test_a_report_covers_the_picks_made_before_its_check():
    view = LoadView()
    view.reported(load(queued=0), covers=0)
    for number in (1, 2, 3):
        view.picked(number, 100)
    assert view.queued_tokens == 300
    view.reported(load(queued=150), covers=2)  # the check went out after picks 1 and 2
    assert view.queued_tokens == 250
    view.forget()
    assert view.queued_tokens == 0 and view.report is None


def test_round_robin_ignores_load():
    views = reported(load(queued=10**6), load(), load())
    chooser = PrefillChooser(PrefillPolicy.ROUND_ROBIN)
    assert [chooser.choose(views, 10) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_nodes_that_report_nothing_are_balanced_by_own_picks():
    views = reported(None, None)
    chooser = PrefillChooser(PrefillPolicy.LEAST_LOADED)
    assert collections.Counter(chooser.choose(views, 50) for _ in range(10)) == {0: 5, 1: 5}


def test_bad_choices_are_refused():
    with pytest.raises(ValueError, match="least-loaded"):
        PrefillPolicy.parse("fastest")
    assert PrefillPolicy.parse("Round-Robin") is PrefillPolicy.ROUND_ROBIN
    with pytest.raises(ValueError, match="no prefill node"):
        PrefillChooser(PrefillPolicy.LEAST_LOADED).choose([], 1)
    with pytest.raises(ValueError, match="prompt tokens"):
        PrefillChooser(PrefillPolicy.LEAST_LOADED).choose(reported(None), -1)
