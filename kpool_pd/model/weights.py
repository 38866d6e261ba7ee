"""The synthetic model's weights, drawn from the seed, and the per-token tensors they give.

Per layer: key and gate tables (token -> bf16[128]) plus a sinusoidal position term, the kpool
``ape`` bias, the QSA RMSNorm weight, indexer query tables (token -> bf16[H, 128]) and head
weights, and the MLA bytes of each token (a token table XOR a position pattern). Everything is
elementwise per token, so a token's tensors never depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kpool_pd.model.config import ModelConfig

D = 128
MLA_POSITION_PERIOD = 257  # prime, so MLA bytes of nearby positions differ


@dataclass(frozen=True)
class LayerInputs:
    """One layer's per-token tensors of a forward (what ``keys``, ``query`` and ``mla_bytes`` give, the same bytes).

    # keys, gates: [T, 128] bf16; mla: [T, mla_entry_bytes] uint8
    # queries: [Q, H, 128] bf16; head_weights: [Q, H] fp32 (the rows' tokens)
    """

    keys: torch.Tensor
    gates: torch.Tensor
    mla: torch.Tensor
    queries: torch.Tensor
    head_weights: torch.Tensor


@dataclass(frozen=True)
class StepInputs:
    """A forward's per-token tensors of a run of ``layers`` at once: a forward computes them in a few launches,
    not a few per layer.

    # keys, gates: [L, T, 128] bf16; mla: [L, T, mla_entry_bytes] uint8
    # queries: [L, Q, H, 128] bf16; head_weights: [L, Q, H] fp32 (the rows' tokens)
    """

    layers: range
    keys: torch.Tensor
    gates: torch.Tensor
    mla: torch.Tensor
    queries: torch.Tensor
    head_weights: torch.Tensor

    def of(self, layer: int) -> LayerInputs:
        """Layer ``layer``'s slice (a layer of ``layers``)."""
        i = self.layers.index(layer)
        return LayerInputs(keys=self.keys[i], gates=self.gates[i], mla=self.mla[i], queries=self.queries[i],
                           head_weights=self.head_weights[i])


def _as_wide(entries: torch.Tensor) -> torch.Tensor:
    """The entries' bytes as the widest integer dtype whose size divides an entry.

    # entries: [..., E] uint8 (contiguous rows) -> [..., E / w] int64 | int32 | int16 | uint8
    """
    for dtype in (torch.int64, torch.int32, torch.int16):
        if entries.shape[-1] % dtype.itemsize == 0:
            return entries.view(dtype)
    return entries


class SyntheticWeights:
    """Seeded weights of one ``ModelConfig`` (CPU tensors; ``to(device)`` moves them)."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        layers, vocab, heads = config.num_layers, config.vocab_size, config.index_heads

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen)

        self.key_table = randn(layers, vocab, D)
        self.gate_table = 2.0 * randn(layers, vocab, D)
        self.position_freq = 0.02 + 0.3 * torch.rand(layers, D, generator=gen)
        self.position_phase = 6.28 * torch.rand(layers, D, generator=gen)
        self.ape = randn(layers, config.cache.kpool, D).contiguous()
        self.norm_weight = 0.2 * randn(layers, D)
        self.query_table = randn(layers, vocab, heads, D)
        self.head_weight = 0.25 + torch.rand(layers, vocab, heads, generator=gen)
        self.mla_table = torch.randint(0, 256, (layers, vocab, config.cache.mla_entry_bytes), generator=gen,
                                       dtype=torch.int64).to(torch.uint8)
        self.mla_position = torch.randint(0, 256, (layers, MLA_POSITION_PERIOD, config.cache.mla_entry_bytes),
                                          generator=gen, dtype=torch.int64).to(torch.uint8)
        # The draft model: a bigram table that the target follows most of the time (see model.rule).
        self.draft_table = torch.randint(0, vocab, (vocab,), generator=gen)
        self.to(device)

    def to(self, device: str | torch.device) -> "SyntheticWeights":
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    def _position_term(self, layer: int | slice, positions: torch.Tensor, shift: float) -> torch.Tensor:
        # positions: [T] int64 -> [T, 128] fp32 (layer: an index), or [L, T, 128] (layer: a slice of layers)
        if isinstance(layer, slice):
            freq, phase = self.position_freq[layer, None], self.position_phase[layer, None]
            angle = positions.to(torch.float32)[None, :, None] * freq + phase + shift
        else:
            angle = positions.to(torch.float32)[:, None] * self.position_freq[layer] + self.position_phase[layer] + shift
        return torch.sin(angle)

    def step_inputs(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                    layers: range | None = None) -> StepInputs:
        """The keys, gates and MLA entries of ``tokens`` and the queries of the ``rows`` among them, for ``layers``
        (a run of consecutive layers; default every layer), with the per-layer methods' arithmetic, element for
        element.

        # tokens, positions: [T] int64; rows: [Q] int64 indices into tokens
        """
        layers = range(self.config.num_layers) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= self.config.num_layers:
            raise ValueError(f"layers must be a run of consecutive layers in [0, {self.config.num_layers}), "
                             f"got {layers}")
        run = slice(layers.start, layers.stop)
        k = self.key_table[run, tokens] + 0.5 * self._position_term(run, positions, 0.0)
        gate = self.gate_table[run, tokens] + self._position_term(run, positions, 1.0)
        row_tokens, row_positions = tokens[rows], positions[rows]
        q = self.query_table[run, row_tokens] + 0.5 * self._position_term(run, row_positions, 2.0)[:, :, None]
        # the MLA bytes gathered and XORed as the widest integers that tile an entry (the same bytes, fewer elements)
        mla = torch.bitwise_xor(_as_wide(self.mla_table[run])[:, tokens],
                                _as_wide(self.mla_position[run])[:, positions % MLA_POSITION_PERIOD])
        mla = mla.view(torch.uint8)
        return StepInputs(layers=layers, keys=k.to(torch.bfloat16), gates=gate.to(torch.bfloat16), mla=mla,
                          queries=q.to(torch.bfloat16), head_weights=self.head_weight[run, row_tokens].contiguous())

    def keys(self, layer: int, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw indexer key and gate score of each token.

        # tokens, positions: [T] int64 -> k, gate: [T, 128] bf16
        """
        k = self.key_table[layer, tokens] + 0.5 * self._position_term(layer, positions, 0.0)
        gate = self.gate_table[layer, tokens] + self._position_term(layer, positions, 1.0)
        return k.to(torch.bfloat16), gate.to(torch.bfloat16)

    def query(self, layer: int, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer query heads and head weights of each token.

        # tokens, positions: [T] int64 -> q: [T, H, 128] bf16, weights: [T, H] fp32
        """
        q = self.query_table[layer, tokens] + 0.5 * self._position_term(layer, positions, 2.0)[:, None]
        return q.to(torch.bfloat16), self.head_weight[layer, tokens].contiguous()

    def mla_bytes(self, layer: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The main-attention entry of each token (fp8 latent, scales and rope as opaque bytes).

        # tokens, positions: [T] int64 -> [T, mla_entry_bytes] uint8
        """
        return torch.bitwise_xor(self.mla_table[layer, tokens],
                                 self.mla_position[layer, positions % MLA_POSITION_PERIOD])
