"""Input checks shared by the ops' public entry points (ValueError/TypeError naming the values).

The convention of every op: its public entry (the op folder's ``__init__``) checks the arguments on
every path (types, ranks, dtypes, sizes, devices; the values, which need a host synchronisation, on CPU
tensors only), then runs the Triton kernel or the torch reference; ``ref.py`` is the math alone. One
int dtype rule: index tensors (offsets, lengths, block tables, ring ids, slots) may be int32 or int64
(``check_int_tensor``); positions are int64. The family-specific checks live in ``kpool_checks`` and, for the
QSA ops, in each op folder's ``checks``.
"""

from __future__ import annotations

import torch

from kpool_pd.kvcache import PoolMode


def describe(t: object) -> str:
    """What a value is, for an error message: a tensor's dtype, shape and device, else its type."""
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return type(t).__name__


def as_pool_mode(mode: PoolMode | str) -> PoolMode:
    if isinstance(mode, PoolMode):
        return mode
    try:
        return PoolMode(mode)
    except ValueError:
        raise ValueError(f"mode must be one of {[m.value for m in PoolMode]}, got {mode!r}") from None


def check_tensor(name: str, t: torch.Tensor, *, dtype: torch.dtype | None = None, rank: int | None = None,
                 shape: tuple[int | None, ...] | None = None) -> None:
    """Rank, dtype and (None = any) sizes of one argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
            want_text = tuple("*" if w is None else w for w in shape)
            raise ValueError(f"{name} must have shape {want_text}, got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")


def check_int_tensor(name: str, t: torch.Tensor, rank: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
