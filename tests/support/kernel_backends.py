"""Where a kernel test body runs: one body, a ``backend`` parameter, three places.

- ``reference``: CPU tensors, the ops run their torch references (``kpool_pd.kernels.dispatch``);
- ``interpreter``: CPU tensors, the ops run their Triton kernels in Triton's interpreter (only where
  ``TRITON_INTERPRET=1``, which tests/conftest.py sets on a machine without CUDA);
- ``cuda``: CUDA tensors, the compiled kernels (marked ``gpu``).

A body takes the ``backend`` fixture, parametrized indirectly with ``backends(...)``, and puts its
tensors on ``backend.device``. The bodies live in the tests/ modules; each tests/gpu/ module imports
the bodies of its family, so the GPU suite (``pytest -m gpu tests/gpu``) runs them on CUDA. So that a
body runs once per backend, tests/conftest.py keeps only the CPU rows (``reference``, ``interpreter``)
of a body collected in a tests/ module and only its ``cuda`` rows in a tests/gpu/ module
(``in_its_suite``): no row is collected only to be skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from kpool_pd.kernels.dispatch import FORCE_TRITON_ENV, INTERPRET_ENV

REFERENCE, INTERPRETER, CUDA = "reference", "interpreter", "cuda"
T = TypeVar("T")


@dataclass(frozen=True)
class Backend:
    name: str
    device: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.name == CUDA

    @property
    def runs_kernels(self) -> bool:
        return self.name != REFERENCE

    def pick(self, cpu: T, cuda: T) -> T:
        """A size for this backend: the interpreter is slow, so CPU backends take the small one."""
        return cuda if self.is_cuda else cpu

    def __repr__(self) -> str:
        return self.name


def backends(*names: str) -> list:
    """Parameters for ``@pytest.mark.parametrize("backend", backends(...), indirect=True)``."""
    return [pytest.param(name, id=name, marks=[pytest.mark.gpu] if name == CUDA else []) for name in names]


KERNEL_BACKENDS = backends(INTERPRETER, CUDA)  # a kernel against its reference
ALL_BACKENDS = backends(REFERENCE, INTERPRETER, CUDA)  # a property of the public ops, whatever runs them


def in_gpu_suite(path: Path) -> bool:
    """A test module of the GPU suite (tests/gpu/)."""
    return path.parent.name == "gpu"


def in_its_suite(item: pytest.Item) -> bool:
    """A collected row runs here: any test without a ``backend`` parameter; a ``cuda`` row only in
    tests/gpu/, a CPU row only in tests/."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or "backend" not in callspec.params:
        return True
    return (callspec.params["backend"] == CUDA) == in_gpu_suite(item.path)


def make_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, *, gpu_suite: bool) -> Backend:
    """The body of each module's ``backend`` fixture (``gpu_suite``: the module lives in tests/gpu/)."""
    name = getattr(request, "param", REFERENCE)
    if (name == CUDA) != gpu_suite:  # tests/conftest.py collects no such row
        raise ValueError(f"the {name} backend runs from the {'tests/' if gpu_suite else 'tests/gpu/'} modules, "
                         f"not from {request.node.path}")
    if name == CUDA:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device: run tests/gpu/run_all.sh on the H200 through the device tool")
        return Backend(CUDA, torch.device("cuda", torch.cuda.current_device()))
    if name == INTERPRETER:
        if os.environ.get(INTERPRET_ENV) != "1":
            pytest.skip(f"the Triton interpreter is off ({INTERPRET_ENV} != 1): on CUDA, tests/gpu runs the kernels")
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    else:
        monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)
    return Backend(name, torch.device("cpu"))


def poison(t: torch.Tensor, seed: int) -> None:
    """Fill t's bytes with random ones (an unwritten byte then never matches), on any device."""
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
