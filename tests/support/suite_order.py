"""The order in which the suite's files go to pytest-xdist's workers (``--dist loadfile --no-loadscope-reorder``):
the slowest first, so that no long file starts last and keeps one worker busy after the other has finished. Each
worker takes the next file as it finishes one, so the slowest first leaves the short files to fill the end.

``SLOWEST_FIRST`` is a measurement (pytest ``--durations`` of the README's test command on the 2-core machine,
each file's setup, call and teardown summed), not a rule: a file missing from it keeps its place after them, in
the order pytest collected it. Within a file the order is pytest's."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

SLOWEST_FIRST: Sequence[str] = (
    "tests/vllm/test_vllm_ranks.py",
    "tests/vllm/test_vllm_hostile.py",
    "tests/e2e/test_e2e_dcp.py",
    "tests/vllm/test_vllm_router.py",
    "tests/e2e/test_e2e.py",
    "tests/vllm/test_vllm_pd.py",
    "tests/kernels/test_kpool_invariant.py",
    "tests/e2e/test_e2e_chunked.py",
    "tests/vllm/test_vllm_ranks_mixed.py",
    "tests/vllm/test_vllm_router_prefetch.py",  # 47 s alone (2026-12-07), not yet measured in the suite
    "tests/vllm/test_vllm_prefetch.py",  # 30 s alone (2026-12-07), not yet measured in the suite
    "tests/workers/test_dcp_stray_connections.py",
    "tests/e2e/test_e2e_cache_options.py",
    "tests/connector/test_connector_processes.py",
    "tests/deploy/test_deploy_launch.py",
    "tests/workers/test_dcp_exposure.py",
    "tests/workers/test_daemon_drain.py",
    "tests/bench/test_bench_transfer_quiet.py",
    "tests/kernels/test_kpool_triton.py",
    "tests/cli/test_e2e_cli.py",
    "tests/e2e/test_fleet.py",
    "tests/e2e/test_e2e_heterogeneous.py",
    "tests/vllm/test_vllm_readme.py",
    "tests/cli/test_up_signals.py",
    "tests/workers/test_soak.py",
    "tests/vllm/test_bench_vllm.py",
    "tests/workers/test_decode_health.py",
    "tests/connector/prefill/test_handshake_hardening.py",
    "tests/workers/test_handshake_daemons.py",
    "tests/workers/test_daemon.py",
    "tests/runtime/test_parent_death.py",
    "tests/workers/test_daemon_credentials.py",
    "tests/workers/test_daemon_tls.py",
    "tests/vllm/test_vllm_hma_specs.py",
)


def slowest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the files of ``SLOWEST_FIRST`` in its order, then the others as collected."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    place = {item.nodeid.split("::", 1)[0]: i for i, item in reversed(list(enumerate(items)))}

    def key(indexed: tuple[int, pytest.Item]) -> tuple[int, int, int]:
        index, item = indexed
        path = item.nodeid.split("::", 1)[0]
        return (rank.get(path, len(rank)), place[path], index)
    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
