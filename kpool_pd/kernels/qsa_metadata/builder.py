"""The QSA metadata builder of an engine: every forward's maps written into buffers allocated once
(sized by ``max_num_batched_tokens`` and ``max_num_seqs``, as vLLM's builders are), and the forward's
host counts (``BatchSplit``: uniform decodes first, spec tokens as decode).

Graph capture: on CUDA the maps come from one Triton launch that reads only the batch's device
tensors and writes only the builder's buffers, at addresses that never change, and the host counts
come from the batch's host copies, so ``build`` never waits on the device. Capture it with the batch
held in tensors of fixed address (int32, as the metadata keeps them; an int64 input is converted into
a new tensor each call), a bucket's ``num_tokens`` and request count (requests past the real ones
with query length 0 and sequence length 0 add nothing); replay after writing the next batch into the
same tensors. The split, a host value, is rebuilt outside the graph.
"""

from __future__ import annotations

import dataclasses

import torch

from kpool_pd.kernels.qsa_metadata import build_qsa_metadata
from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata, max_work_items, metadata_outputs
from kpool_pd.kernels.qsa_metadata.split import split_uniform_decodes


class QsaMetadataBuilder:
    """One per engine and device: ``build`` for each forward."""

    def __init__(self, *, compress_ratio: int, ring_capacity: int, block_size: int, num_spec: int,
                 max_num_batched_tokens: int, max_num_seqs: int, device: torch.device | str) -> None:
        for name, value, least in (("num_spec", num_spec, 0), ("max_num_batched_tokens", max_num_batched_tokens, 1),
                                   ("max_num_seqs", max_num_seqs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.compress_ratio, self.ring_capacity, self.block_size = compress_ratio, ring_capacity, block_size
        self.decode_threshold = 1 + num_spec  # a decode step: the last committed token and its drafts
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.buffers = metadata_outputs(max_num_batched_tokens,
                                        max_work_items(max_num_batched_tokens, max_num_seqs, compress_ratio),
                                        torch.device(device))

    def build(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              ring_blocks: torch.Tensor, *, query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor,
              num_tokens: int | None = None) -> QsaMetadata:
        """The forward's metadata over the builder's buffers (valid until the next ``build``), with
        ``split`` set from the host copies, which are those of the real requests: the first of the
        device batch's requests (those past them are a bucket's padding, idle). ``num_tokens`` (a
        bucket's size, at least the real tokens) defaults to the real tokens; ValueError for a batch
        larger than the buffers or host copies that cannot be its own.

        # query_start_loc: [B + 1] int; seq_lens: [B] int; block_table: [B, M] int; ring_blocks: [B] int
        # query_start_loc_cpu: [B + 1] int (CPU); seq_lens_cpu: [B] int (CPU)
        """
        split = split_uniform_decodes(query_start_loc_cpu, seq_lens_cpu, decode_threshold=self.decode_threshold)
        requests = seq_lens.shape[0] if seq_lens.dim() == 1 else 0
        if seq_lens_cpu.shape[0] > requests:
            raise ValueError(f"seq_lens_cpu holds {seq_lens_cpu.shape[0]} requests, seq_lens "
                             f"{list(seq_lens.shape)}: the host copies are of the batch's real requests")
        if num_tokens is None:
            num_tokens = split.num_actual_tokens
        if num_tokens < split.num_actual_tokens:
            raise ValueError(f"num_tokens {num_tokens} < the batch's {split.num_actual_tokens} tokens")
        if num_tokens > self.max_num_batched_tokens or requests > self.max_num_seqs:
            raise ValueError(f"a forward of {num_tokens} tokens and {requests} requests exceeds the builder's "
                             f"max_num_batched_tokens {self.max_num_batched_tokens} or max_num_seqs "
                             f"{self.max_num_seqs}")
        out = {name: buffer[:num_tokens] for name, buffer in self.buffers.items()
               if name not in ("k_work", "num_work")}
        out["k_work"] = self.buffers["k_work"][:max_work_items(num_tokens, requests, self.compress_ratio)]
        out["num_work"] = self.buffers["num_work"]
        metadata = build_qsa_metadata(query_start_loc, seq_lens, block_table, ring_blocks,
                                      compress_ratio=self.compress_ratio, ring_capacity=self.ring_capacity,
                                      block_size=self.block_size, num_tokens=num_tokens, out=out)
        return dataclasses.replace(metadata, split=split)
