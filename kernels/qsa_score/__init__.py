"""QSA top-k selection over the compressed key cache, expanded to token positions."""

from kernels.qsa_score.ref import qsa_topk

__all__ = ["qsa_topk"]
