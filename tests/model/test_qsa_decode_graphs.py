"""QSA decode steps through the engine's graphed path, decided and run on the CPU (the CUDA replay is
tests/gpu/test_qsa_decode_graphs_gpu.py's).

The engine's QSA decode graphs pad a bucket with empty requests, carry each request's MRoPE delta and build the
step's metadata in the family's one ``QsaMetadataBuilder``. Here a bucket's "capture" keeps its forward and a
"replay" runs it again over the bucket's buffers (``eager_capture``), so everything but the CUDA graph runs: the
bucket choice, the padding (real requests first, then requests of no token, the padding tokens belonging to none),
the deltas, the builder's buffers. Continuous batching through buckets of 4, 2 and 1 requests, with drafts and MRoPE
prompts, must emit the eager engine's tokens and leave its cache bytes after every step.
"""

from __future__ import annotations

import pytest
import torch

from kpool_pd.kvcache import BlockLayout, CacheFamily, CachePool
from kpool_pd.model import ModelConfig, decode_graphs
from kpool_pd.model.batch import build_batch
from kpool_pd.model.decode_graphs import BucketGraph, DecodeBucket, RequestPadding
from kpool_pd.model.engine import DecodeSequence, Engine, PrefillJob
from kpool_pd.model.prompt import mrope_delta
from tests.support.allocations import placed
from tests.support.mrope_prompts import image_prompt_positions

CPU = torch.device("cpu")


class EagerReplay:
    """A stand-in for a captured CUDA graph on the CPU: ``replay`` runs the captured forward again (over the same
    buffers, as a graph's kernels would) and writes its hashes where the capture's were."""

    def __init__(self, forward) -> None:
        self.forward = forward
        self.hashes = forward()

    def replay(self) -> None:
        self.hashes.copy_(self.forward())


def eager_capture(forward, memory, device):
    graph = EagerReplay(forward)
    return graph, graph.hashes


def config(num_spec: int) -> ModelConfig:
    return ModelConfig.build(family=CacheFamily.QSA, num_layers=2, compress_ratio=4, num_spec=num_spec,
                             block_size=64, cache_rope_positions=True)


PROMPTS = [  # (length, image (start, rows, cols) or None, max_tokens): requests end at different steps
    (37, (3, 4, 5), 40),
    (13, None, 3),
    (70, (10, 6, 6), 20),
    (23, (0, 2, 3), 9),
]


def prefilled(cfg: ModelConfig) -> tuple[Engine, list[DecodeSequence]]:
    pool = CachePool(BlockLayout(cfg.cache), num_blocks=16, num_rings=4, device=CPU)
    engine = Engine(cfg, pool)
    jobs, seqs = [], []
    for i, (length, image, max_tokens) in enumerate(PROMPTS):
        prompt = [(11 * i + 7 * j + 3) % cfg.vocab_size for j in range(length)]
        positions = image_prompt_positions(length, *image) if image else ()
        blocks = [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3]
        jobs.append(PrefillJob(prompt=prompt, block_ids=blocks, ring_id=i, mrope_positions=positions))
        seqs.append(DecodeSequence(request_id=f"r{i}", prompt_len=length, max_tokens=max_tokens,
                                   allocation=placed(pool, blocks, i), output=[],
                                   mrope_delta=mrope_delta(positions, length)))
    for seq, first in zip(seqs, engine.prefill(jobs)):
        seq.output.append(first)
    return engine, seqs


def release(*runs: list[DecodeSequence]) -> None:
    for seqs in runs:
        for seq in seqs:
            seq.allocation.release()


def test_the_prompts_have_images():
    positions = image_prompt_positions(37, 3, 4, 5)
    assert positions[3:8] == ((3, 3, 3), (3, 3, 4), (3, 3, 5), (3, 3, 6), (3, 3, 7))
    assert positions[22] == (3, 6, 7) and positions[23] == (8, 8, 8) and positions[36] == (21, 21, 21)
    assert mrope_delta(positions, 37) == 22 - 37  # the first generated token (index 37) at (22, 22, 22)


@pytest.mark.parametrize("num_spec", [0, 3])
def test_graphed_qsa_decode_equals_eager_step_for_step(monkeypatch, num_spec):
    monkeypatch.setattr(decode_graphs, "capture", eager_capture)
    cfg = config(num_spec)
    eager, eager_seqs = prefilled(cfg)
    graphed, graphed_seqs = prefilled(cfg)
    assert torch.equal(graphed.pool.rings, eager.pool.rings)
    graphed.graphs = graphed._decode_graphs(4, 1)
    built = []
    forward = graphed._graphed_forward
    graphed.graphs.forward = lambda batch: built.append(batch) or forward(batch)
    buckets = []
    steps = 0
    while not all(s.finished for s in eager_seqs):
        live = sum(not s.finished for s in graphed_seqs)
        want = eager.decode_step(eager_seqs)
        got = graphed.decode_step(graphed_seqs)
        assert got == want, f"step {steps}"
        assert [s.drafts_accepted for s in graphed_seqs] == [s.drafts_accepted for s in eager_seqs]
        # a graphed step writes num_spec drafts for every request, past the committed length where fewer are real
        # (as a rejected draft does), so the digests compare the committed state: entries, open group, MLA bytes
        for seq_e, seq_g in zip(eager_seqs, graphed_seqs):
            assert graphed.state_digest(seq_g.block_ids, seq_g.ring_id, seq_g.cached) == \
                eager.state_digest(seq_e.block_ids, seq_e.ring_id, seq_e.cached), f"step {steps}: {seq_e.request_id}"
        buckets.append(live)
        steps += 1
    assert [s.output for s in graphed_seqs] == [s.output for s in eager_seqs]
    release(eager_seqs, graphed_seqs)
    assert {bucket.requests for bucket in graphed.graphs._graphs} >= {4, 2, 1}
    assert len(set(buckets)) >= 3 and steps >= 4
    # every replay ran over its bucket's buffers and built its metadata in the builder's
    assert built, "no step ran through the graphs"
    inputs = {}
    for batch in built:
        key = batch.tokens.shape[0]
        inputs.setdefault(key, batch.tokens.data_ptr())
        assert batch.tokens.data_ptr() == inputs[key], "a replay's batch is not over its bucket's buffers"


def test_a_replayed_qsa_step_builds_its_metadata_in_the_builders_buffers(monkeypatch):
    monkeypatch.setattr(decode_graphs, "capture", eager_capture)
    engine, seqs = prefilled(config(3))
    engine.graphs = engine._decode_graphs(4, 1)
    builder = engine.family.builder
    addresses = {name: buffer.data_ptr() for name, buffer in builder.buffers.items()}
    seen = []
    real = engine.family._metadata_of

    def spy(batch):
        metadata = real(batch)
        seen.append({name: getattr(metadata, name).data_ptr() for name in addresses})
        return metadata

    engine.family._metadata_of = spy
    for _ in range(3):
        engine.decode_step(seqs)
    assert len(seen) >= 3 * engine.config.num_layers  # every layer of every step
    release(seqs)
    assert all(ptrs == addresses for ptrs in seen)
    assert engine.family.builder is builder
    assert {name: buffer.data_ptr() for name, buffer in builder.buffers.items()} == addresses


@pytest.mark.parametrize("family, padding, mrope", [(CacheFamily.KPOOL, RequestPadding.TOKENS, False),
                                                    (CacheFamily.QSA, RequestPadding.EMPTY, True)],
                         ids=["kpool", "qsa"])
def test_each_family_gets_its_graphs(family, padding, mrope):
    cfg = ModelConfig.build(family=family, num_layers=1, num_spec=3)
    engine = Engine(cfg, CachePool(BlockLayout(cfg.cache), num_blocks=2, num_rings=1, device=CPU))
    graphs = engine._decode_graphs(300, 2)
    assert (graphs.padding, graphs.mrope, graphs.k) == (padding, mrope, 4)
    if family is CacheFamily.QSA:  # room for the largest bucket (300 requests of 4 tokens) before any capture
        assert engine.family.builder.max_num_seqs >= 300 and engine.family.builder.max_num_batched_tokens >= 1200


def test_an_empty_padded_bucket_puts_its_padding_tokens_in_no_request():
    graph = BucketGraph(DecodeBucket(requests=4, table_width=2), 3, CPU, padding=RequestPadding.EMPTY, mrope=True)
    graph.fill([([5, 6, 7], 40, [1, 2], 0), ([8, 9, 10], 7, [3], 2)], [4, 0])
    batch = graph.batch()
    assert batch.query_start_loc.tolist() == [0, 3, 6, 6, 6]
    assert batch.seq_lens.tolist() == [43, 10, 0, 0] and batch.ring_ids.tolist() == [0, 2, -1, -1]
    assert batch.positions.tolist() == [40, 41, 42, 7, 8, 9] + [-1] * 6
    assert batch.mrope_positions.tolist() == [[44] * 3, [45] * 3, [46] * 3, [7] * 3, [8] * 3, [9] * 3] + [[-1] * 3] * 6
    assert batch.block_table.tolist() == [[1, 2], [3, -1], [-1, -1], [-1, -1]]
    assert batch.row_request.tolist() == [0] * 3 + [1] * 3 + [3] * 6  # padding rows read a padded request
    graph.fill([([1, 2, 3], 0, [4], 1)])  # a later step: the earlier requests' fields are padding again
    again = graph.batch()
    assert again.query_start_loc.tolist() == [0, 3, 3, 3, 3] and again.ring_ids.tolist() == [1, -1, -1, -1]
    assert again.mrope_positions[:3].tolist() == [[0] * 3, [1] * 3, [2] * 3]
    kpool = BucketGraph(DecodeBucket(requests=2, table_width=1), 3, CPU)
    kpool.fill([([5, 6, 7], 40, [1], 0)])
    assert kpool.batch().query_start_loc.tolist() == [0, 3, 6] and kpool.batch().mrope_positions is None


def test_graphs_refuse_deltas_they_do_not_carry(monkeypatch):
    monkeypatch.setattr(decode_graphs, "capture", eager_capture)
    cfg = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=1, num_spec=0)
    engine = Engine(cfg, CachePool(BlockLayout(cfg.cache), num_blocks=2, num_rings=1, device=CPU))
    graphs = engine._decode_graphs(2, 1)
    with pytest.raises(ValueError, match=r"mrope_deltas \[3\] for 1 requests"):
        graphs.run([([1], 0, [0], 0)], [3])


def test_a_padded_qsa_batch_hashes_and_writes_what_the_unpadded_batch_does():
    """The forward a QSA graph captures, on a bucket of 4 requests holding 2 (the metadata reference pads as the
    Triton builder does), against the eager forward of the two: the same real rows' hashes and the same bytes."""
    cfg = config(1)
    runs = [prefilled(cfg) for _ in range(2)]
    engines = [engine for engine, _ in runs]
    release(*(seqs for _, seqs in runs))
    chunks = [([7, 8], 37, [0, 1, 2, 3], 0), ([9, 10], 70, [8, 9, 10, 11], 2)]
    eager, graphed = engines
    delta = mrope_delta(image_prompt_positions(37, 3, 4, 5), 37)
    mrope = [torch.arange(37 + delta, 39 + delta)[:, None].expand(-1, 3), None]
    want = eager._decode_forward(build_batch(chunks, last_only=False, device=CPU, mrope_positions=mrope))
    graph = BucketGraph(DecodeBucket(requests=4, table_width=4), 2, CPU, padding=RequestPadding.EMPTY, mrope=True)
    graph.fill(chunks, [delta, 0])
    got = graphed._graphed_forward(graph.batch())
    assert torch.equal(got[:4], want)
    assert torch.equal(graphed.pool.blocks, eager.pool.blocks)
    assert torch.equal(graphed.pool.rings, eager.pool.rings)


@pytest.mark.parametrize("family", ["kpool", "qsa"])
def test_the_decode_daemon_graphs_either_family_on_cuda_and_the_prefill_daemon_kpool_alone(family):
    """What the daemons hand their engines (the device only named: nothing is allocated): a decode daemon on CUDA
    replays steps of up to max-running requests for either family, eagerly with cuda-graphs off or on the CPU; a
    prefill daemon's graphs serve kpool alone."""
    from kpool_pd.decode_worker.daemon import OPTIONS as DECODE_OPTIONS, graph_requests
    from kpool_pd.prefill_worker.daemon import OPTIONS as PREFILL_OPTIONS
    from kpool_pd.runtime import Role, cuda_graphs_serve
    from kpool_pd.runtime.settings import load_settings

    def decode(*flags: str) -> dict:
        return load_settings(Role.DECODE, DECODE_OPTIONS, ["--family", family, "--max-running", "6", *flags], env={})

    cuda = torch.device("cuda", 0)
    assert graph_requests(decode(), cuda) == 6
    assert graph_requests(decode(), CPU) == 0
    assert graph_requests(decode("--cuda-graphs", "false"), cuda) == 0
    prefill = load_settings(Role.PREFILL, PREFILL_OPTIONS, ["--family", family], env={})
    assert cuda_graphs_serve(prefill, cuda) is (family == "kpool")
