"""The state digest on CUDA (every layer read at once) equals the per-layer reads, whose kpool entries come
through the Triton entry reader."""

from __future__ import annotations

import pytest
import torch

from kpool_pd.kvcache import CacheFamily
from kpool_pd.model import ModelConfig
from tests.model.test_state_digest import check_state_digest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("family", [CacheFamily.KPOOL, CacheFamily.QSA])
@pytest.mark.parametrize("prompt_len,max_tokens", [(301, 6), (512, 9)])
def test_state_digest_on_cuda_equals_the_per_layer_reads(family, prompt_len, max_tokens):
    check_state_digest(ModelConfig.build(family=family, num_layers=4, num_spec=3), prompt_len, max_tokens, "cuda")
