"""The next-token rule of the target model and the draft rule.

Target: each layer's features of a query row (model.*_family ``features``: the selected
compressed entries and their bytes, the open pool, the MLA bytes of the attended tokens) are
hashed linearly modulo the prime P = 2**31 - 1 with nonzero seeded weights, so changing any one
byte changes that layer's hash; the layers' hashes are chained, mixed (splitmix64), and the mix
picks the token: with probability about 3/4 the draft model's guess for the current token,
otherwise a token drawn from the mix. Draft: the seeded bigram table alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kpool_pd.model.weights import SyntheticWeights

HASH_PRIME = (1 << 31) - 1
LAYER_MULTIPLIER = 48271
MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def fold_layer(acc: torch.Tensor, weights: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The chained hash after one more layer: acc * 48271 + sum_f features[f] * weights[f], modulo P.

    # acc: [Q] int64 in [0, P); weights: [F] int64 in [1, P); features: [Q, F] int64 in [0, 2**31)
    # -> [Q] int64 in [0, P)
    """
    layer_hash = (features * weights).sum(dim=1) % HASH_PRIME
    return (acc * LAYER_MULTIPLIER + layer_hash) % HASH_PRIME


class TokenRule:
    """Seeded hash weights for features of width ``feature_width`` on ``num_layers`` layers."""

    def __init__(self, weights: SyntheticWeights, feature_width: int) -> None:
        config = weights.config
        gen = torch.Generator().manual_seed(config.seed + 1)
        self.hash_weights = torch.randint(1, HASH_PRIME, (config.num_layers, feature_width), generator=gen,
                                          dtype=torch.int64).to(weights.draft_table.device)
        self.draft_table = weights.draft_table
        self._draft_list = weights.draft_table.tolist()
        self.vocab_size = config.vocab_size

    def start(self, rows: int, device: torch.device) -> torch.Tensor:
        """# -> [rows] int64, the chained hash before the first layer"""
        return torch.zeros(rows, dtype=torch.int64, device=device)

    def chain(self, acc: torch.Tensor, layer: int, features: torch.Tensor) -> torch.Tensor:
        """Fold one layer's features into the chained hash.

        # acc: [Q] int64 in [0, P); features: [Q, F] int64 in [0, 2**31) -> [Q] int64 in [0, P)
        """
        if features.shape[1] != self.hash_weights.shape[1]:
            raise ValueError(f"features have width {features.shape[1]}, the rule expects {self.hash_weights.shape[1]}")
        return fold_layer(acc, self.hash_weights[layer], features)

    def next_tokens(self, hashes: Sequence[int], current: Sequence[int]) -> list[int]:
        """The target's next token after each row's current token, from the row's chained hash."""
        out = []
        for h, token in zip(hashes, current, strict=True):
            mixed = splitmix64(h)
            out.append(self._draft_list[token] if mixed & 3 else (mixed >> 2) % self.vocab_size)
        return out

    def drafts(self, token: int, count: int) -> list[int]:
        """``count`` draft tokens following ``token`` (bigram chain)."""
        out = []
        for _ in range(count):
            token = self._draft_list[token]
            out.append(token)
        return out
