"""Frozen cache specs: the parameters that decide every byte of the caches.

Each spec validates itself in ``__post_init__`` (ValueError naming the numbers) and exposes
its derived sizes as properties. Change a spec with ``dataclasses.replace``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

INDEX_HEAD_DIM = 128  # fixed by the Hadamard-128 rotation
FP8_ENTRY_BYTES = INDEX_HEAD_DIM + 4  # 128 fp8 bytes + one fp32 scale
KERNEL_PAGE_STATES = (32, 64)  # states per kernel page that DeepGEMM's paged MQA takes (only 64 on SM120)
DEFAULT_KERNEL_PAGE_STATES = 64
DEFAULT_MLA_ENTRY_BYTES = 656  # 512 fp8 + 4 fp32 scales + 64 bf16 rope
QSA_ROTARY_DIM = 64
QSA_POSITION_SLOTS = 12  # 3 int64 MRoPE positions packed into 12 bf16 slots


class PoolMode(enum.Enum):
    """How a kpool pool of raw keys becomes one vector."""

    SOFTMAX = "softmax"
    KEEP_LAST = "keep_last"


class CacheFamily(enum.Enum):
    KPOOL = "kpool"
    QSA = "qsa"


class BlockOrder(enum.Enum):
    """Order of a page's axes: Block, Layer, N tokens, H heads, C channels."""

    BLNHC = "BLNHC"
    BLHNC = "BLHNC"


class CacheDtype(enum.Enum):
    """Storage dtype of the QSA compressed key cache (AUTO means the model dtype, bf16)."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self in (CacheDtype.AUTO, CacheDtype.BFLOAT16):
            return torch.bfloat16
        return torch.float8_e4m3fn

    @property
    def canonical(self) -> "CacheDtype":
        """AUTO and BFLOAT16 store the same bytes, as do FP8 and FP8_E4M3."""
        return CacheDtype.BFLOAT16 if self.torch_dtype == torch.bfloat16 else CacheDtype.FP8_E4M3


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    _require_positive(n=n)
    return 1 << (n - 1).bit_length()


def tail_ring_size(kpool: int, num_spec: int) -> int:
    """Slots R of the kpool tail ring: kpool * next_pow2(ceil((kpool + num_spec) / kpool)).

    R >= kpool + num_spec, so the open pool plus one step of 1 + num_spec tokens never
    wraps onto itself and a redo after a rejected draft still finds its keys.
    """
    _require_positive(kpool=kpool)
    if not isinstance(num_spec, int) or num_spec < 0:
        raise ValueError(f"num_spec must be an integer >= 0, got {num_spec!r}")
    return kpool * next_pow2(math.ceil((kpool + num_spec) / kpool))


def qsa_ring_capacity(compress_ratio: int, num_spec: int) -> int:
    """Rows C of the QSA key state ring: r * ceil((r + num_spec) / r) (no power of two)."""
    _require_positive(compress_ratio=compress_ratio)
    if not isinstance(num_spec, int) or num_spec < 0:
        raise ValueError(f"num_spec must be an integer >= 0, got {num_spec!r}")
    return compress_ratio * math.ceil((compress_ratio + num_spec) / compress_ratio)


@dataclass(frozen=True, kw_only=True)
class MlaPageSpec:
    """Main-attention page of one layer in one block: block_size tokens x num_heads x entry_bytes."""

    block_size: int
    entry_bytes: int = DEFAULT_MLA_ENTRY_BYTES
    num_heads: int = 1
    order: BlockOrder = BlockOrder.BLNHC

    def __post_init__(self) -> None:
        _require_positive(block_size=self.block_size, entry_bytes=self.entry_bytes, num_heads=self.num_heads)

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.num_heads * self.entry_bytes


@dataclass(frozen=True, kw_only=True)
class KpoolIndexerSpec:
    """kpool indexer cache of one layer in one block: S = block_size / kpool fp8 entries, held in
    ``pages_per_block`` kernel pages of ``states_per_page`` states each, back to back.

    ``kernel_page_states`` is P, the kernel's page (32 or 64 states). A block with S <= P is one
    page of S states; a block with S > P holds S / P pages of P states (S must be a multiple of P).
    Each page is DeepGEMM's paged-MQA layout: its entries' 128 fp8 bytes state-major, then their
    fp32 scales. State s of a block is entry ``s % states_per_page`` of page ``s // states_per_page``.
    """

    kpool: int
    block_size: int
    mode: PoolMode = PoolMode.SOFTMAX
    round_scale: bool = True
    head_dim: int = INDEX_HEAD_DIM
    kernel_page_states: int = DEFAULT_KERNEL_PAGE_STATES

    def __post_init__(self) -> None:
        _require_positive(kpool=self.kpool, block_size=self.block_size, head_dim=self.head_dim)
        if self.kpool < 2:
            raise ValueError(f"kpool must be >= 2, got {self.kpool}")
        if self.head_dim != INDEX_HEAD_DIM:
            raise ValueError(f"head_dim must be {INDEX_HEAD_DIM} (Hadamard-128), got {self.head_dim}")
        if self.block_size % self.kpool:
            raise ValueError(f"block_size {self.block_size} is not a multiple of kpool {self.kpool}")
        if self.kernel_page_states not in KERNEL_PAGE_STATES or isinstance(self.kernel_page_states, bool):
            raise ValueError(
                f"kernel_page_states must be one of {KERNEL_PAGE_STATES} (the kernel's page), "
                f"got {self.kernel_page_states!r}"
            )
        states = self.states_per_block
        if states > self.kernel_page_states and states % self.kernel_page_states:
            raise ValueError(
                f"S = block_size / kpool = {self.block_size} / {self.kpool} = {states} exceeds the kernel page "
                f"of {self.kernel_page_states} states and is not a multiple of it"
            )
        if not isinstance(self.mode, PoolMode):
            raise ValueError(f"mode must be a PoolMode, got {self.mode!r}")

    @property
    def states_per_block(self) -> int:
        """S = block_size / kpool."""
        return self.block_size // self.kpool

    @property
    def states_per_page(self) -> int:
        """States of one kernel page: min(S, P)."""
        return min(self.states_per_block, self.kernel_page_states)

    @property
    def pages_per_block(self) -> int:
        """Kernel pages of one layer in one block: S / states_per_page (1 when S <= P)."""
        return self.states_per_block // self.states_per_page

    @property
    def kernel_page_bytes(self) -> int:
        """One kernel page: states_per_page * 132 (its fp8 entries, then its fp32 scales)."""
        return self.states_per_page * FP8_ENTRY_BYTES

    @property
    def page_bytes(self) -> int:
        """One layer's indexer pages in one block, back to back: S * 132."""
        return self.states_per_block * FP8_ENTRY_BYTES


@dataclass(frozen=True, kw_only=True)
class TailRingSpec:
    """Per request and layer: bf16[2, R, D], raw K then gate, position pos at slot pos % R."""

    kpool: int
    num_spec: int
    block_size: int
    head_dim: int = INDEX_HEAD_DIM

    def __post_init__(self) -> None:
        _require_positive(block_size=self.block_size, head_dim=self.head_dim)
        if self.block_size % self.ring_size:
            raise ValueError(
                f"tail ring size R = {self.ring_size} (kpool {self.kpool}, num_spec {self.num_spec}) "
                f"does not divide block_size {self.block_size}"
            )

    @property
    def ring_size(self) -> int:
        return tail_ring_size(self.kpool, self.num_spec)

    @property
    def row_bytes(self) -> int:
        """One slot of one layer: K and gate, bf16[2, D]."""
        return 2 * self.head_dim * 2


@dataclass(frozen=True, kw_only=True)
class QsaCompressedKeySpec:
    """QSA compressed key page: block_size / r rows x num_heads x head_size, bf16 or fp8."""

    compress_ratio: int
    block_size: int
    head_size: int = INDEX_HEAD_DIM
    num_heads: int = 1
    dtype: CacheDtype = CacheDtype.BFLOAT16
    order: BlockOrder = BlockOrder.BLNHC
    rotary_dim: int = QSA_ROTARY_DIM
    mrope_section: tuple[int, int, int] = (12, 10, 10)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _require_positive(
            compress_ratio=self.compress_ratio, block_size=self.block_size,
            head_size=self.head_size, num_heads=self.num_heads, rotary_dim=self.rotary_dim,
        )
        if self.block_size % self.compress_ratio:
            raise ValueError(
                f"block_size {self.block_size} is not a multiple of compress_ratio {self.compress_ratio}"
            )
        if not isinstance(self.dtype, CacheDtype):
            raise ValueError(f"dtype must be a CacheDtype, got {self.dtype!r}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_size:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and <= head_size {self.head_size}")
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.rotary_dim // 2:
            raise ValueError(
                f"mrope_section {self.mrope_section} must have 3 parts summing to rotary_dim/2 = {self.rotary_dim // 2}"
            )

    @property
    def rows_per_block(self) -> int:
        return self.block_size // self.compress_ratio

    @property
    def element_bytes(self) -> int:
        return self.dtype.torch_dtype.itemsize

    @property
    def page_bytes(self) -> int:
        return self.rows_per_block * self.num_heads * self.head_size * self.element_bytes


@dataclass(frozen=True, kw_only=True)
class QsaKeyStateRingSpec:
    """Per request and layer: bf16[C, H, W] raw keys; W = off + 12 with packed int64 positions."""

    compress_ratio: int
    num_spec: int
    block_size: int
    head_size: int = INDEX_HEAD_DIM
    num_heads: int = 1
    cache_rope_positions: bool = False  # the seed's default (QSAKeyStateCache)

    def __post_init__(self) -> None:
        _require_positive(block_size=self.block_size, head_size=self.head_size, num_heads=self.num_heads)
        if self.block_size % self.capacity:
            raise ValueError(
                f"QSA ring capacity C = {self.capacity} (compress_ratio {self.compress_ratio}, "
                f"num_spec {self.num_spec}) does not divide block_size {self.block_size}"
            )

    @property
    def capacity(self) -> int:
        return qsa_ring_capacity(self.compress_ratio, self.num_spec)

    @property
    def position_offset(self) -> int:
        """bf16 offset of the packed positions: ceil(D/4)*4 keeps them 8-byte aligned."""
        return math.ceil(self.head_size / 4) * 4

    @property
    def row_width(self) -> int:
        if self.cache_rope_positions:
            return self.position_offset + QSA_POSITION_SLOTS
        return self.head_size

    @property
    def row_bytes(self) -> int:
        """One slot of one layer: bf16[H, W]."""
        return self.num_heads * self.row_width * 2
