"""One forward's QSA cache update (prefill chunk or decode step with drafts alike)."""

from kernels.qsa_update.ref import qsa_forward_update

__all__ = ["qsa_forward_update"]
