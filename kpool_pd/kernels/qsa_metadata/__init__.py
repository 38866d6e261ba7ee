"""Per-forward metadata of the QSA cache ops: token maps, ring and compressed slots, work items.

One forward's maps: ``build_qsa_metadata``; with the host counts and preallocated buffers, forward
after forward: ``kpool_pd.kernels.qsa_metadata.builder.QsaMetadataBuilder``."""

from __future__ import annotations

import dataclasses

import torch

from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.qsa_metadata.checks import check_metadata_args, check_metadata_values
from kpool_pd.kernels.qsa_metadata import ref
from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata, max_work_items
from kpool_pd.kernels.qsa_metadata.split import BatchSplit, split_uniform_decodes


@on_tensor_device
def build_qsa_metadata(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, ring_blocks: torch.Tensor, *,
    compress_ratio: int, ring_capacity: int, block_size: int, num_tokens: int | None = None,
    out: dict[str, torch.Tensor] | None = None,
) -> QsaMetadata:
    """The metadata of one forward (see ``ref``): Triton on CUDA tensors, the reference on CPU.

    ``num_tokens`` (T, the tokens of the forward) fixes every output size; when given on CUDA tensors
    the build never waits on the device and can be captured in a CUDA graph (``k_work`` is padded to
    ``max_work_items(T, B, r)``, ``num_work`` stays on the device). When omitted it is read from
    ``query_start_loc[-1]``, one host synchronisation. A T above ``query_start_loc[-1]`` pads the forward:
    its last tokens belong to no request (``ref``), on both paths. Both paths check ranks, dtypes and sizes; the
    values (offsets, lengths, blocks that receive a group) are checked on CPU tensors only. ``out``
    (``ref.metadata_outputs``' names and shapes for ``num_tokens``) receives the maps instead of fresh
    tensors: a builder's preallocated buffers (``QsaMetadataBuilder``).

    # query_start_loc: [B + 1] int; seq_lens: [B] int; block_table: [B, M] int; ring_blocks: [B] int
    """
    if num_tokens is not None and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0):
        raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
    check_metadata_args(query_start_loc, seq_lens, block_table, ring_blocks, compress_ratio, ring_capacity,
                        block_size)
    # int64 inputs are accepted; the metadata holds them as int32 (its documented fields), converted on the device
    query_start_loc, seq_lens, block_table, ring_blocks = (
        t.to(torch.int32) for t in (query_start_loc, seq_lens, block_table, ring_blocks))
    if not query_start_loc.is_cuda:
        check_metadata_values(query_start_loc, seq_lens, block_table, ring_blocks, compress_ratio,
                              block_size)
        if num_tokens is not None and num_tokens < int(query_start_loc[-1]):
            raise ValueError(f"num_tokens {num_tokens} < query_start_loc[-1] = {int(query_start_loc[-1])}, the "
                             "forward's real tokens")
    if not use_triton(query_start_loc):
        built = ref.build_qsa_metadata(query_start_loc, seq_lens, block_table, ring_blocks,
                                       compress_ratio=compress_ratio, ring_capacity=ring_capacity,
                                       block_size=block_size, num_tokens=num_tokens)
        return built if out is None else _copied_into(built, out)
    if num_tokens is None:
        num_tokens = int(query_start_loc[-1])
    from kpool_pd.kernels.qsa_metadata.triton import build_qsa_metadata_triton

    return build_qsa_metadata_triton(query_start_loc, seq_lens, block_table, ring_blocks,
                                     compress_ratio=compress_ratio, ring_capacity=ring_capacity,
                                     block_size=block_size, num_tokens=num_tokens, out=out)


def _copied_into(built: QsaMetadata, out: dict[str, torch.Tensor]) -> QsaMetadata:
    """``built``'s maps written into ``out`` (same names and shapes), and the metadata over ``out``."""
    for name, target in out.items():
        source = getattr(built, name)
        if target.shape != source.shape or target.dtype != source.dtype:
            raise ValueError(f"out[{name!r}] is {target.dtype} {list(target.shape)}, the metadata needs "
                             f"{source.dtype} {list(source.shape)}")
        target.copy_(source)
    return dataclasses.replace(built, **out)


__all__ = ["BatchSplit", "QsaMetadata", "build_qsa_metadata", "max_work_items", "split_uniform_decodes"]
