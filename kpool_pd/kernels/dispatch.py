"""Which implementation an op runs: its Triton kernel or its torch reference.

The rule, read from the environment at every call (no cached state):
- tensors on a CUDA device run the Triton kernel;
- every op launches on its tensors' device (``on_tensor_device``), never on the process's current
  device: a pool on cuda:1 works while cuda:0 is current;
- CPU tensors run the torch reference, unless ``KPOOL_PD_FORCE_TRITON=1``, which runs the Triton
  kernel on CPU tensors too; that needs Triton's interpreter (``TRITON_INTERPRET=1`` set before
  the kernel modules are first imported), which is how CI tests the kernels without a GPU.
"""

from __future__ import annotations

import functools
import itertools
import os
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

FORCE_TRITON_ENV = "KPOOL_PD_FORCE_TRITON"
INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return os.environ.get(INTERPRET_ENV, "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """True when an op whose tensors live where ``tensor`` lives should run its Triton kernel."""
    if tensor.is_cuda:
        return True
    if os.environ.get(FORCE_TRITON_ENV, "0") != "1":
        return False
    if not interpreting():
        raise RuntimeError(
            f"{FORCE_TRITON_ENV}=1 on CPU tensors needs Triton's interpreter: set {INTERPRET_ENV}=1 before the "
            "kernel modules are imported"
        )
    return True


def on_tensor_device(op: F) -> F:
    """Decorator of every public op: run it with its first tensor argument's CUDA device current, so
    its kernel launches (and the stream they go to) follow the tensors, not the caller's current device.
    CPU tensors, and a call whose device is already current, run unchanged."""

    @functools.wraps(op)
    def run(*args, **kwargs):
        first = next((a for a in itertools.chain(args, kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or not first.is_cuda or first.device.index == torch.cuda.current_device():
            return op(*args, **kwargs)
        with torch.cuda.device(first.device):
            return op(*args, **kwargs)

    return run  # type: ignore[return-value]
