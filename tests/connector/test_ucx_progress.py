"""How the connector chooses ucxx's progress mode (``kpool_pd.connector.shared.ucx_progress``): a spinning
progress thread only for a GPU pool on a machine with cores to spare, the operator's variable over any choice,
and a clear error for a setting that is not a UcxProgress."""

from __future__ import annotations

import pytest

from kpool_pd.connector import ConnectorConfig, UcxProgress, progress_mode_for
from kpool_pd.connector.shared.ucx_progress import POLLING_MIN_CORES, PROGRESS_ENV, usable_cores


@pytest.mark.parametrize("device,cores,expected", [
    ("cuda", POLLING_MIN_CORES, "thread-polling"),
    ("cuda", 128, "thread-polling"),
    ("cuda", POLLING_MIN_CORES - 1, "thread"),  # a small machine: no core to give to a spinning thread
    ("cpu", 128, "thread"),  # host memory over tcp: a message wakes the sleeping thread anyway
])
def test_auto_spins_only_for_a_gpu_pool_with_cores_to_spare(device, cores, expected):
    assert progress_mode_for(UcxProgress.AUTO, device, cores=cores, environ={}) == expected


@pytest.mark.parametrize("progress", [UcxProgress.THREAD, UcxProgress.THREAD_POLLING])
@pytest.mark.parametrize("device,cores", [("cpu", 2), ("cuda", 64)])
def test_an_explicit_choice_holds_on_any_machine(progress, device, cores):
    assert progress_mode_for(progress, device, cores=cores, environ={}) == progress.value


def test_the_operators_variable_leaves_the_choice_to_ucxx():
    """None: ucxx reads UCXPY_PROGRESS_MODE itself (an empty value counts as unset)."""
    for progress in UcxProgress:
        assert progress_mode_for(progress, "cuda", cores=64, environ={PROGRESS_ENV: "blocking"}) is None
    assert progress_mode_for(UcxProgress.AUTO, "cuda", cores=64, environ={PROGRESS_ENV: ""}) == "thread-polling"


def test_usable_cores_counts_this_process():
    assert 1 <= usable_cores() <= 4096


def test_a_setting_that_is_not_a_ucx_progress_is_refused():
    with pytest.raises(ValueError, match=r"ucx_progress must be one of \['AUTO', 'THREAD', 'THREAD_POLLING'\].*'thread'"):
        ConnectorConfig(ucx_progress="thread")
    with pytest.raises(TypeError, match="progress must be a UcxProgress, got 'auto'"):
        progress_mode_for("auto", "cuda")
    assert ConnectorConfig().ucx_progress is UcxProgress.AUTO
