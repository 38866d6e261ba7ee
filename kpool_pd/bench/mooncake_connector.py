"""vLLM 0.32's MooncakeConnector, as ``kpool-pd bench vllm`` runs it on a host with no accelerator.

On such a host ``MooncakeConnectorWorker.__init__`` asks ``torch.accelerator.current_device_index()`` and
fails with "Cannot access accelerator device when none is available". That call only picks the CUDA
device its sender threads bind to, so while the connector is built with no accelerator present the
index is answered 0 (the CPU platform's ``set_device`` takes it). With an accelerator nothing changes.

vLLM loads this class by ``kv_connector_module_path`` (``kpool_pd.bench.mooncake_connector``) under vLLM's
own name, ``MooncakeConnector``, so that vLLM's checks by connector name still apply to it. Importing this
module imports vLLM: only an engine's process does (``kpool_pd.bench.vllm_mooncake`` is the bench's side).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as vllm_mooncake


@contextlib.contextmanager
def device_index_without_accelerator() -> Iterator[None]:
    """``torch.accelerator.current_device_index()`` answers 0 inside, when no accelerator is present."""
    if torch.accelerator.is_available():
        yield
        return
    with mock.patch.object(torch.accelerator, "current_device_index", return_value=0):
        yield


class MooncakeConnector(vllm_mooncake.MooncakeConnector):
    """vLLM's MooncakeConnector, built with ``device_index_without_accelerator`` in force."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        with device_index_without_accelerator():
            super().__init__(vllm_config, role, kv_cache_config)
