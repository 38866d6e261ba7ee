"""Compression of complete QSA groups into normed, group-first-RoPE rows (bf16 or fp8)."""

from kernels.qsa_compress.ref import compress_group_keys

__all__ = ["compress_group_keys"]
