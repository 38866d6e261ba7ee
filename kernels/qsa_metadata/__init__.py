"""Per-forward metadata of the QSA cache ops: token maps, ring and compressed slots, work items."""

from kernels.qsa_metadata.ref import QsaMetadata, build_qsa_metadata, max_work_items

__all__ = ["QsaMetadata", "build_qsa_metadata", "max_work_items"]
