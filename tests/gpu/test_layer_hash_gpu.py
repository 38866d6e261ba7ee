"""The fused layer hash compiled on a CUDA device.

The kernel-against-reference bodies are tests/model/test_layer_hash.py's, run here on the ``cuda`` backend
(tests/support/kernel_backends.py): real caches filled by the engine on the GPU, the family's own top-k, padding rows,
equality bit for bit. Here as well, what only a GPU shows: the fused op never synchronises with the host and
captures in a CUDA graph, alone and as the whole per-layer chain of a forward (``family.chain`` on every layer:
the query, the top-k and the fused hash), whose replay gives the reference's hashes.
"""

from __future__ import annotations

import pytest
import torch

from kpool_pd.kvcache import BlockOrder, CacheDtype, CacheFamily
from kpool_pd.model.layer_hash import kpool_layer_hash, qsa_layer_hash, ref
from kpool_pd.model.rule import HASH_PRIME
from tests.support.kernel_backends import Backend, make_backend
from tests.model.test_layer_hash import build_engine, batches, test_fused_hash_equals_reference  # noqa: F401

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: run tests/gpu/run_all.sh on the H200 through the device tool")

GRAPH_CASES = [
    pytest.param(dict(family=CacheFamily.KPOOL, kpool=4, num_spec=3, block_order=BlockOrder.BLHNC,
                      mla_entry_bytes=656), id="kpool4-spec3-blhnc"),
    pytest.param(dict(family=CacheFamily.QSA, compress_ratio=4, num_spec=3, qsa_dtype=CacheDtype.FP8_E4M3,
                      mla_entry_bytes=656), id="qsa4-spec3-fp8"),
]
PROMPTS = [1, 4, 5, 63, 64, 65, 255, 256, 257, 700]


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=True)


def _graph_case(options):
    """A 3-layer CUDA engine of ``options`` and its decode batch of drafts."""
    engine, sequences = build_engine(dict(options), False, PROMPTS, torch.device("cuda"), layers=3)
    return engine, batches(engine, sequences)[1]


def _fused_and_ref(engine):
    family = engine.family
    if engine.config.cache.family is CacheFamily.KPOOL:
        return kpool_layer_hash, ref.kpool_layer_hash, dict(kpool=family.kpool)
    return qsa_layer_hash, ref.qsa_layer_hash, dict(compress_ratio=family.ratio)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("options", GRAPH_CASES)
def test_fused_hash_never_syncs_and_captures(options):
    engine, batch = _graph_case(options)
    fused, reference, kw = _fused_and_ref(engine)
    family, rule = engine.family, engine.rule
    selections = [family.select(layer, batch) for layer in range(3)]
    acc = torch.randint(0, HASH_PRIME, (batch.rows.shape[0],), device="cuda")
    want = acc
    for layer, selection in enumerate(selections):
        want = reference(want, rule.hash_weights[layer], *selection, *family.layer_views(layer), **kw)
    args = [(rule.hash_weights[layer], *selection, *family.layer_views(layer)) for layer, selection in
            enumerate(selections)]
    fused(acc, *args[0], **kw)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        fused(acc, *args[0], **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_acc = torch.zeros_like(acc)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static_acc
        for layer_args in args:
            out = fused(out, *layer_args, **kw)
    static_acc.copy_(acc)
    graph.replay()
    assert torch.equal(out, want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("options", GRAPH_CASES)
def test_the_whole_chain_of_a_forward_captures(options):
    """Every layer's ``family.chain`` (query, top-k, fused hash) in one CUDA graph gives the reference's hash."""
    engine, batch = _graph_case(options)
    family, rule = engine.family, engine.rule
    rows = batch.rows.shape[0]
    want = rule.start(rows, engine.device)
    for layer in range(3):
        want = rule.chain(want, layer, family.features(layer, batch))

    def chain() -> torch.Tensor:
        acc = rule.start(rows, engine.device)
        for layer in range(3):
            acc = family.chain(acc, layer, batch, rule)
        return acc

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert torch.equal(chain(), want)  # eager, and every kernel compiled outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    graph.replay()
    assert torch.equal(out, want)
