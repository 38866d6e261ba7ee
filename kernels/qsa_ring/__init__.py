"""The QSA key state ring: raw keys and packed MRoPE positions of a request's recent tokens."""

from kernels.qsa_ring.ref import position_offset, read_qsa_ring_positions, write_qsa_ring

__all__ = ["position_offset", "read_qsa_ring_positions", "write_qsa_ring"]
