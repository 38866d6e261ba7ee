"""kpool pool compression: hand-computed fp8 entries, the Hadamard rotation, input checks."""

from __future__ import annotations

import math

import pytest
import torch

from kpool_pd.kernels import hadamard_matrix, kpool_compress
from kpool_pd.kernels.fp8 import pow2_ceil
from kpool_pd.kernels.hadamard import fwht


def _one_hot_pool(kpool: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = torch.zeros(1, kpool, 128, dtype=torch.bfloat16)
    k[0, kpool - 1, 0] = 1.0
    return k, torch.zeros_like(k), torch.zeros(kpool, 128)


def test_keep_last_one_hot_entry_by_hand():
    # x = e0; y_d = 1/sqrt(128) = 0.0883883..., bf16 -> 181/2048 = 0.08837890625 for every d.
    # amax/448 = 1.9727e-4, ceil(log2) = -12, scale = 2**-12; y/scale = 362 -> e4m3 rounds to 352
    # (1.375 * 2**8): sign 0, exponent 8+7 = 0b1111, mantissa 0b011 -> byte 0x7B.
    q, scale = kpool_compress(*_one_hot_pool(), mode="keep_last", round_scale=True)
    assert scale.tolist() == [2.0**-12]
    assert q.view(torch.uint8).tolist() == [[0x7B] * 128]


def test_keep_last_one_hot_entry_without_round_scale():
    # scale = amax / 448 exactly, so y/scale = 448 -> 1.75 * 2**8 -> byte 0x7E.
    q, scale = kpool_compress(*_one_hot_pool(), mode="keep_last", round_scale=False)
    assert scale.item() == pytest.approx(0.08837890625 / 448, rel=1e-7)
    assert q.view(torch.uint8).tolist() == [[0x7E] * 128]


def test_softmax_of_equal_gates_is_the_mean():
    # Equal logits: weights 1/kpool. Keys e0 in slot 0 and 3*e0 in slot 1 of a pool of 2: x = 2*e0.
    k = torch.zeros(1, 2, 128, dtype=torch.bfloat16)
    k[0, 0, 0], k[0, 1, 0] = 1.0, 3.0
    q, scale = kpool_compress(k, torch.zeros_like(k), torch.zeros(2, 128), mode="softmax")
    # y_d = 2/sqrt(128) = 0.1767767 -> bf16 0.1767578125 (181/1024); scale 2**-11; y/scale = 362 -> 0x7B.
    assert scale.tolist() == [2.0**-11]
    assert q.view(torch.uint8).tolist() == [[0x7B] * 128]


def test_softmax_weights_follow_gate_plus_ape():
    # Slot 1's logit is larger by ln(3): weights 1/4, 3/4; keys 0 and 4*e0 -> x = 3*e0 exactly.
    k = torch.zeros(1, 2, 128, dtype=torch.bfloat16)
    k[0, 1, 0] = 4.0
    ape = torch.zeros(2, 128)
    ape[1] = math.log(3.0)
    q, scale = kpool_compress(k, torch.zeros_like(k), ape)
    dequant = q.to(torch.float32) * scale[:, None]
    assert torch.allclose(dequant, torch.full((1, 128), 3 / math.sqrt(128)), rtol=0.07)


def test_hadamard_is_orthogonal_and_sylvester_ordered():
    h = hadamard_matrix(128)
    assert torch.equal(h @ h.T, 128 * torch.eye(128))
    assert torch.equal(h[0], torch.ones(128))
    assert torch.equal(h[1], torch.tensor([1.0, -1.0] * 64))
    assert torch.equal(h[:64, 64:], h[:64, :64]) and torch.equal(h[64:, 64:], -h[64:, :64])


def test_butterflies_equal_the_matrix_product():
    x = torch.randn(9, 128, dtype=torch.float64)
    assert torch.allclose(fwht(x), x @ hadamard_matrix(128).to(torch.float64).T, atol=1e-12)


def test_pow2_ceil_is_exact_on_and_off_powers_of_two():
    x = torch.tensor([0.25, 0.3, 1.0, 1.0000001, 448.0, 3e-7], dtype=torch.float32)
    assert pow2_ceil(x).tolist() == [0.25, 0.5, 1.0, 2.0, 512.0, 2.0**-21]


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.zeros(2, 4, 64, dtype=torch.bfloat16),) * 2 + (torch.zeros(4, 64),), "head dim 128"),
        ((torch.zeros(2, 4, 128),) * 2 + (torch.zeros(4, 128),), "bfloat16"),
        ((torch.zeros(2, 4, 128, dtype=torch.bfloat16),) * 2 + (torch.zeros(3, 128),), r"\(4, 128\)"),
        ((torch.zeros(2, 1, 128, dtype=torch.bfloat16),) * 2 + (torch.zeros(1, 128),), "kpool must be >= 2"),
    ],
    ids=["bad-dim", "fp32-keys", "ape-shape", "kpool-1"],
)
def test_bad_inputs_name_the_values(args, message):
    with pytest.raises(ValueError, match=message):
        kpool_compress(*args)


def test_unknown_mode_is_refused():
    k, gate, ape = _one_hot_pool()
    with pytest.raises(ValueError, match="'mean'"):
        kpool_compress(k, gate, ape, mode="mean")
