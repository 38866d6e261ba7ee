"""Which implementation an op runs: its Triton kernel or its torch reference.

The rule, read from the environment at every call (no cached state):
- tensors on a CUDA device run the Triton kernel;
- CPU tensors run the torch reference, unless ``KPOOL_PD_FORCE_TRITON=1``, which runs the Triton
  kernel on CPU tensors too; that needs Triton's interpreter (``TRITON_INTERPRET=1`` set before
  the kernel modules are first imported), which is how CI tests the kernels without a GPU.
"""

from __future__ import annotations

import os

import torch

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
