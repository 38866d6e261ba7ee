"""Interleaved MRoPE cos/sin tables and NeoX rotary (the QSA compressed keys' position encoding)."""

from kernels.qsa_rope.ref import apply_neox_rotary, mrope_axis_of_pair, mrope_cos_sin, rope_inv_freq, text_positions

__all__ = ["apply_neox_rotary", "mrope_axis_of_pair", "mrope_cos_sin", "rope_inv_freq", "text_positions"]
