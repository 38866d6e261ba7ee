"""The tests, a folder per part of the product; ``tests.support`` holds what they share.

The helpers lived in this folder before ``tests.support`` held them: a test that imports one by its
old name (``from tests.polling import wait_for``) gets the same module from ``tests.support``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

MOVED_TO_SUPPORT = frozenset({
    "allocations", "arrangements", "connector_bytes", "connector_engines", "connector_harness", "connector_procs",
    "dcp_daemons", "dcp_ranks", "deploy_crds", "deploy_daemons", "deploy_image", "deploy_launch", "deploy_manifests",
    "handshake_procs", "kernel_backends", "kpool_sim", "log_records", "mrope_prompts", "peer_credentials", "polling",
    "ports", "pulls", "router_fakes", "serving", "user_folders", "vllm_servers", "vllm_spec_caches",
    "vllm_spec_procs", "vllm_worker_pair",
})


class _SupportAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``tests.<helper>`` as the module ``tests.support.<helper>`` itself (one module, one state)."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED_TO_SUPPORT:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.support.{spec.name.rpartition('.')[2]}")
        self._own_specs[spec.name] = module.__spec__  # the import system sets the alias's spec on it next
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


if not any(isinstance(finder, _SupportAlias) for finder in sys.meta_path):
    sys.meta_path.append(_SupportAlias())
