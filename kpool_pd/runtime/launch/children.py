"""A Python function in a child process: the tests' connector nodes and the benches' peers.

Every child of a CPU-only node imports torch (about 1.6 s on the 2-core CI machine). A
``ChildKind.PRELOADED`` child is forked from multiprocessing's fork server, which imported torch
once (and nothing that starts threads or opens devices: no gRPC, no UCX, no CUDA). A fork server
keeps the environment it was started with, so each child gets the parent's environment as it is
when the child starts (a test's ``monkeypatch.setenv`` reaches it) before the function runs.
``ChildKind.SPAWN`` is a fresh interpreter (what a child needs when it must import torch under
another environment than the fork server's, which only a fresh interpreter gives).

The target is any picklable function (defined at a module's top level); a child may also set
torch's intra-op threads (``threads``): two busy children on two cores run small ops faster on one
thread each than on two that contend.
"""

from __future__ import annotations

import enum
import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

PRELOAD = ["torch"]  # imported once by the fork server, before any child forks from it


class ChildKind(enum.Enum):
    """How a child process starts."""

    PRELOADED = "forkserver"  # forked from a server that imported ``PRELOAD``
    SPAWN = "spawn"  # a fresh interpreter that imports everything itself


def child_context(kind: ChildKind = ChildKind.PRELOADED) -> BaseContext:
    """The multiprocessing context of ``kind`` (for its ``Pipe()`` and ``Queue()`` as well)."""
    if kind is ChildKind.PRELOADED and "forkserver" not in mp.get_all_start_methods():
        kind = ChildKind.SPAWN  # not on this platform
    context = mp.get_context(kind.value)
    if kind is ChildKind.PRELOADED:
        context.set_forkserver_preload(PRELOAD)
    return context


def _run(environ: dict[str, str], threads: int | None, target: Callable, args: tuple, kwargs: dict) -> None:
    """The child's entry: the parent's environment, torch's threads, then ``target``."""
    os.environ.clear()
    os.environ.update(environ)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    target(*args, **kwargs)


def start_child(target: Callable, *args, kind: ChildKind = ChildKind.PRELOADED, threads: int | None = None,
                daemon: bool = True, name: str | None = None, **kwargs) -> BaseProcess:
    """Start ``target(*args, **kwargs)`` in a child process of ``kind`` and return it (started;
    ``daemon``: terminated when this process exits). ``threads``: torch's intra-op threads in the
    child (None: torch's default)."""
    if threads is not None and threads < 1:
        raise ValueError(f"threads is {threads}; must be at least 1 (or None for torch's default)")
    process = child_context(kind).Process(target=_run, args=(dict(os.environ), threads, target, args, kwargs),
                                          daemon=daemon, name=name)
    process.start()
    return process
