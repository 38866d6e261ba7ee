"""The hop stamps' loop steps (connector.shared.hops.StepCountingLoop): how many hand-overs a pull took between
two hops of one process."""

import asyncio

import pytest

from kpool_pd.connector.shared import hops


@pytest.fixture
def recorder():
    recorder = hops.HopRecorder().install()
    yield recorder
    recorder.uninstall()


def test_a_counting_loop_stamps_its_steps_and_a_task_running_on_takes_none(recorder):
    async def pull():
        hops.stamp("g", "read")
        hops.stamp("g", "checked")  # no await in between: the same step
        await asyncio.sleep(0)  # one hand-over
        hops.stamp("g", "lent")
        await asyncio.get_running_loop().create_task(asyncio.sleep(0))  # the task's step, then ours
        hops.stamp("g", "send")

    with asyncio.Runner(loop_factory=hops.StepCountingLoop) as runner:
        runner.run(pull())
    steps = recorder.steps["g"]
    assert steps["checked"] - steps["read"] == 0
    assert steps["lent"] - steps["read"] == 1
    assert steps["send"] - steps["lent"] >= 2
    assert list(recorder.stamps["g"]) == ["read", "checked", "lent", "send"]


def test_a_loop_that_does_not_count_stamps_times_only(recorder):
    async def pull():
        hops.stamp("h", "read")

    asyncio.run(pull())
    assert "read" in recorder.stamps["h"] and recorder.steps == {}
