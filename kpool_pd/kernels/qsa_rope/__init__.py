"""Interleaved MRoPE cos/sin tables and NeoX rotary (the QSA compressed keys' position encoding), and the
cos/sin table by position that the QSA ops can read instead of computing (``RopeCache``)."""

from kpool_pd.kernels.qsa_rope.cache import RopeCache, rope_inv_freq
from kpool_pd.kernels.qsa_rope.ref import apply_neox_rotary, mrope_axis_of_pair, mrope_cos_sin, text_positions

__all__ = ["RopeCache", "apply_neox_rotary", "mrope_axis_of_pair", "mrope_cos_sin", "rope_inv_freq",
           "text_positions"]
