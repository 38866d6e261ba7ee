"""The ``--device`` option: where a daemon's cache pool and model live (cpu, cuda or cuda:N)."""

from __future__ import annotations

import re
from typing import Any

import torch

from kpool_pd.runtime.options import SettingsError

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def device_name(text: Any) -> str:
    """The option's parser: ``cpu``, ``cuda`` or ``cuda:N`` (case and surrounding space ignored)."""
    value = str(text).strip().lower()
    if not _DEVICE.fullmatch(value):
        raise ValueError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return value


def resolve_device(text: str) -> torch.device:
    """The torch device that ``--device`` names (``cuda`` alone: the current CUDA device);
    ``SettingsError`` when it is CUDA and this process has no such CUDA device."""
    device = torch.device(text)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise SettingsError(f"device {text}: CUDA is not available here (torch {torch.__version__}, built for CUDA "
                            f"{torch.version.cuda or 'none'}); run with --device cpu or on a machine with a GPU")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise SettingsError(f"device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
