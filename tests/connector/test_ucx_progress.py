"""How the connector chooses ucxx's progress mode (``kpool_pd.connector.shared.ucx_progress``): a spinning
progress thread only for a GPU pool on a machine with cores to spare, the operator's variable over any choice,
and a clear error for a setting that is not a UcxProgress."""

from __future__ import annotations

import pytest

from kpool_pd.connector import ConnectorConfig, UcxProgress, describe_progress_mode, progress_mode_for
from kpool_pd.connector.shared.ucx_progress import POLLING_MIN_CORES, PROGRESS_ENV, cgroup_cpu_limit, usable_cores


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


def test_a_cgroup_cpu_quota_caps_the_cores(tmp_path):
    """A pod's limits.cpu (cgroup v2 cpu.max, else v1's cfs quota) caps what AUTO counts; no quota leaves the
    affinity's count; a file that cannot be read counts as no quota."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_limit(v2) == 2.5
    assert usable_cores(v2) == min(usable_cores(tmp_path), 2)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("800000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1) == 8.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(v1) is None
    (v2 / "cpu.max").write_text("garbage")
    assert cgroup_cpu_limit(v2) is None
    half = tmp_path / "half"
    half.mkdir()
    (half / "cpu.max").write_text("50000 100000\n")
    assert usable_cores(half) == 1  # half a core still counts as one


def test_the_choice_is_described_with_its_reason(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    assert describe_progress_mode(UcxProgress.AUTO, "cpu") == \
        f"thread (the connector's default for a cpu pool on {usable_cores()} cores)"
    assert describe_progress_mode(UcxProgress.THREAD_POLLING, "cpu").startswith(
        "thread-polling (ucx_progress=THREAD_POLLING for a cpu pool")
    monkeypatch.setenv(PROGRESS_ENV, "blocking")
    assert describe_progress_mode(UcxProgress.AUTO, "cuda") == f"blocking ({PROGRESS_ENV})"


def test_a_zero_or_negative_cgroup_quota_counts_as_none(tmp_path):
    for text in ("100000 0\n", "0 100000\n", "-1 100000\n"):
        (tmp_path / "cpu.max").write_text(text)
        assert cgroup_cpu_limit(tmp_path) is None, text
