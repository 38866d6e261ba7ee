"""The transfer bench reads a push's exposed time off the one clock of its processes (``push_exposed_s``)."""

import pytest

from kpool_pd.bench.transfer_connector import push_exposed_s


def test_from_the_prompt_stamp_to_the_receive_under_either_key():
    prefill = {"g1": {"prompt": 10.0, "send": 10.1}, "g2": {"prompt": 20.0}}
    decode = {"push-r1": {"received": 10.5}, "g2": {"received": 20.25, "landed": 20.4}}
    assert push_exposed_s({"g1": "push-r1", "g2": "push-r2"}, decode, prefill) == pytest.approx([0.5, 0.25])


def test_a_push_missing_a_stamp_gives_no_time_and_none_is_negative():
    prefill_a, prefill_b = {"g1": {"prompt": 5.0}}, {"g3": {"prompt": 9.0}}
    decode = {"g1": {"received": 4.0}, "g2": {"received": 3.0}, "g3": {"landed": 9.5}}
    # g1 received before its prompt stamp (a clock read earlier in the same step): 0, not negative; g2 has no
    # prompt, g3 no receive
    assert push_exposed_s({"g1": "push-a", "g2": "push-b", "g3": "push-c"}, decode, prefill_a, prefill_b) == [0.0]
