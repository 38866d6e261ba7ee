"""Cache ops of both families: each op folder holds a plain-torch reference (``ref.py``) and its Triton
kernels (``triton.py``), except ``qsa_rope``, torch only (the MRoPE tables and rotary that the QSA ops
share); the package exports the dispatching entry points only (``kpool_pd.kernels.dispatch`` says which
implementation runs).

Shared pieces: ``checks`` and ``kpool_checks`` (the argument checks every public entry runs, on every
path; a QSA op keeps its own in its folder's ``checks``), ``triton_helpers`` (launch options and the bit-exact conversions the kernels
share), ``fp8`` and ``hadamard`` (constants and math of both paths), ``dispatch`` (which implementation
runs, and on which device: an op launches on its tensors' device, never the process's current one).

Importing the package loads every op's entry point and reference, kpool and QSA alike; an op's
``triton`` module is imported on the op's first Triton call."""

from kpool_pd.kernels.hadamard import hadamard_matrix
from kpool_pd.kernels.kpool_cache import kpool_read_entries, kpool_write_entries
from kpool_pd.kernels.kpool_compress import kpool_compress
from kpool_pd.kernels.kpool_decode import kpool_decode_update
from kpool_pd.kernels.kpool_prefill import kpool_prefill
from kpool_pd.kernels.kpool_score import kpool_indexer_topk
from kpool_pd.kernels.mla_rows import write_mla_rows
from kpool_pd.kernels.qsa_compress import compress_group_keys
from kpool_pd.kernels.qsa_metadata import QsaMetadata, build_qsa_metadata
from kpool_pd.kernels.qsa_ring import read_qsa_ring_positions, write_qsa_ring
from kpool_pd.kernels.qsa_rope import mrope_cos_sin, text_positions
from kpool_pd.kernels.qsa_score import qsa_topk
from kpool_pd.kernels.qsa_update import qsa_forward_update
from kpool_pd.kernels.token_repack import block_ids_on, repack_tokens

__all__ = [
    "hadamard_matrix", "kpool_compress", "kpool_decode_update", "kpool_indexer_topk", "kpool_prefill",
    "kpool_read_entries", "kpool_write_entries", "QsaMetadata", "build_qsa_metadata", "compress_group_keys",
    "mrope_cos_sin", "qsa_forward_update", "qsa_topk", "read_qsa_ring_positions",
    "block_ids_on", "repack_tokens", "text_positions", "write_mla_rows", "write_qsa_ring",
]
