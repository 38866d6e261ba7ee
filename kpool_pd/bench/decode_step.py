"""The engine's decode step, eager and replayed from CUDA graphs, at several batch sizes, for the kpool and the QSA
family, in one run.

Per mode and batch: the median wall time of a step, its host time (the wall time less the time the host
waits in CUDA synchronisations), the GPU's busy time (the sum of the step's kernel times), the kernel
launches and graph launches a step makes and its host synchronisations (torch's profiler, over a few
profiled steps apart from the timed ones), and the tokens a second (accepted drafts count). Every request
holds a prompt of ``--prompt-len`` tokens (one batched prefill) and decodes without end; graphed steps are
timed after their bucket was captured. Eager and graphed runs start from the same prefilled state on one
pool each, and their tokens must agree (a mismatch fails the bench). Each graphed row's step time is also
given as a ratio to its family's eager row of the same batch. QSA rows use --ratio tokens a compressed row and
keep MRoPE positions in the ring (its models' setting); their graphs build each step's metadata in the engine's
one QsaMetadataBuilder.

    python -m kpool_pd.bench.decode_step --device cuda --layers 61 --batches 1,16,64     (kpool-pd bench decode)
    python -m kpool_pd.bench.decode_step --device cuda --families qsa --batches 1,16,64
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kpool_pd.bench.arguments import bench_parser, count, counts
from kpool_pd.kvcache import BlockLayout, CacheAllocation, CacheFamily, NodeCache
from kpool_pd.model import ModelConfig
from kpool_pd.model.engine import DecodeSequence, Engine, PrefillJob

logger = logging.getLogger("kpool_pd.bench.decode_step")

LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def families(text: str) -> list[CacheFamily]:
    """A comma-separated list of cache families (kpool, qsa), at least one."""
    try:
        return [CacheFamily(part.strip()) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected families of {[f.value for f in CacheFamily]} separated by commas, "
                                         f"got {text!r}") from None


@dataclass(frozen=True)
class Row:
    family: str  # kpool | qsa
    mode: str  # eager | graphed
    batch: int
    step_ms: float  # median wall time of a step
    tokens_per_s: float
    tokens: tuple[tuple[int, ...], ...]  # every request's tokens (compared between modes, left out of the JSON)
    profile: StepProfile  # the profiled steps: host ms (less the waits in synchronisations), GPU ms, launches, syncs

    def json(self) -> dict:
        """The row's JSON object: its numbers, the profile's four per step, not the tokens or the kernels."""
        p = self.profile
        return {"family": self.family, "mode": self.mode, "batch": self.batch, "step_ms": self.step_ms,
                "host_ms": p.host_ms, "gpu_ms": p.gpu_ms, "launches": p.launches, "syncs": p.syncs,
                "tokens_per_s": self.tokens_per_s}


def prefilled(config: ModelConfig, batch: int, prompt_len: int, steps: int, device: torch.device,
              graph_requests: int) -> tuple[Engine, list[DecodeSequence], list[CacheAllocation]]:
    """An engine on a pool of its own holding ``batch`` prefilled requests with room for ``steps`` steps, and
    their allocations (the caller releases them)."""
    max_tokens = steps * (1 + config.cache.num_spec) + 1
    need = config.cache.blocks_for_request(prompt_len, max_tokens)
    cache = NodeCache(BlockLayout(config.cache), num_blocks=need * batch, num_rings=batch, device=device)
    engine = Engine(config, cache.pool, graph_requests=graph_requests)
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=gen).tolist()
    allocations = [cache.allocate(f"r{b}", need) for b in range(batch)]
    firsts = engine.prefill([PrefillJob(prompt=p, block_ids=a.block_ids, ring_id=a.ring_id)
                             for p, a in zip(prompts, allocations)])
    seqs = [DecodeSequence(request_id=f"r{b}", prompt_len=prompt_len, max_tokens=max_tokens, allocation=a,
                           output=[first]) for b, (a, first) in enumerate(zip(allocations, firsts))]
    return engine, seqs, allocations


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class StepProfile:
    """A call's host ms, GPU ms, kernel and graph launches and host synchronisations (per call, over the profiled
    calls), and its kernels by GPU time: (name, launches a call, us a call), most time first."""

    host_ms: float
    gpu_ms: float
    launches: float
    syncs: float
    kernels: tuple[tuple[str, float, float], ...]

    def kernel_table(self, top: int) -> str:
        lines = [f"{'kernel':60} {'a call':>7} {'us a call':>10}"]
        lines += [f"{name[:60]:60} {calls:>7.1f} {us:>10.1f}" for name, calls, us in self.kernels[:top]]
        return "\n".join(lines)


def profiled(step: Callable[[], object], steps: int, device: torch.device) -> StepProfile:
    """``step`` over ``steps`` profiled calls (the kernels a replayed graph runs count as its own)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall_ms = (time.perf_counter() - began) * 1000
    events = prof.events()
    waited_us = sum(e.cpu_time_total for e in events if e.name in SYNC_CALLS)
    kernels: dict[str, list[float]] = {}
    for e in events:
        if e.device_type is not None and e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset")):
            count_us = kernels.setdefault(e.name, [0, 0.0])
            count_us[0] += 1
            count_us[1] += e.device_time_total
    gpu_us = sum(us for _, us in kernels.values())
    launches = sum(1 for e in events if e.name in LAUNCH_CALLS)
    syncs = sum(1 for e in events if e.name in SYNC_CALLS) - 1  # less the bench's own synchronize after the steps
    by_time = sorted(((name, n / steps, us / steps) for name, (n, us) in kernels.items()), key=lambda k: -k[2])
    return StepProfile(host_ms=(wall_ms - waited_us / 1000) / steps, gpu_ms=gpu_us / 1000 / steps,
                       launches=launches / steps, syncs=syncs / steps, kernels=tuple(by_time))


def measure(config: ModelConfig, batch: int, *, graphed: bool, prompt_len: int, warmup: int, steps: int,
            profile_steps: int, device: torch.device) -> Row:
    total = warmup + steps + profile_steps
    engine, seqs, allocations = prefilled(config, batch, prompt_len, total, device, batch if graphed else 0)
    try:
        for _ in range(warmup):
            engine.decode_step(seqs)
        times, emitted = [], 0
        for _ in range(steps):
            synchronize(device)
            began = time.perf_counter()
            out = engine.decode_step(seqs)
            times.append(time.perf_counter() - began)
            emitted += sum(len(tokens) for tokens in out)
        step = profiled(lambda: engine.decode_step(seqs), profile_steps, device)
    finally:
        for allocation in allocations:
            allocation.release()
    return Row(family=config.cache.family.value, mode="graphed" if graphed else "eager", batch=batch,
               step_ms=statistics.median(times) * 1000,
               tokens_per_s=emitted / sum(times), tokens=tuple(tuple(s.output) for s in seqs), profile=step)


def table(rows: list[Row]) -> str:
    eager = {(r.family, r.batch): r for r in rows if r.mode == "eager"}
    lines = [f"{'family':6} {'mode':8} {'batch':>5} {'step ms':>9} {'host ms':>9} {'GPU ms':>8} {'launches':>9} "
             f"{'syncs':>6} {'tokens/s':>10} {'x eager':>8}"]
    for r in rows:
        base = eager.get((r.family, r.batch))
        ratio = f"{r.step_ms / base.step_ms:.3f}" if base is not None and r.mode != "eager" else ""
        p = r.profile
        lines.append(f"{r.family:6} {r.mode:8} {r.batch:>5} {r.step_ms:>9.2f} {p.host_ms:>9.2f} {p.gpu_ms:>8.2f} "
                     f"{p.launches:>9.0f} {p.syncs:>6.1f} {r.tokens_per_s:>10.0f} {ratio:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("kpool-pd bench decode", __doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (eager and graphed rows) or cpu (eager rows); default cuda where there is one")
    parser.add_argument("--layers", type=count, default=61, help="model layers (default 61)")
    parser.add_argument("--families", type=families, default=list(CacheFamily), metavar="F,F",
                        help="cache families to measure (default kpool,qsa)")
    parser.add_argument("--kpool", type=count, default=4, help="tokens a pool (default 4)")
    parser.add_argument("--ratio", type=count, default=4, help="QSA tokens a compressed row (default 4)")
    parser.add_argument("--num-spec", type=int, default=3, help="draft tokens a step (default 3)")
    parser.add_argument("--batches", type=counts, default=[1, 16, 64], metavar="N,N",
                        help="requests a step (default 1,16,64)")
    parser.add_argument("--prompt-len", type=count, default=512, help="prompt tokens of every request (default 512)")
    parser.add_argument("--steps", type=count, default=20, help="timed steps per row (default 20)")
    parser.add_argument("--warmup", type=count, default=3, help="steps before timing (default 3)")
    parser.add_argument("--profile-steps", type=count, default=3, help="profiled steps per row (default 3)")
    parser.add_argument("--kernels", type=int, default=0, metavar="N", help="also print the N kernels that take the "
                        "most GPU time in a step of the first batch size, graphed where there are graphs (default 0)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for decode_step.json "
                        "(default bench/results)")
    args = parser.parse_args(argv)
    if args.num_spec < 0:
        parser.error(f"--num-spec must be >= 0, got {args.num_spec}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    modes = (False, True) if device.type == "cuda" else (False,)
    rows = []
    for family in dict.fromkeys(args.families):
        config = ModelConfig.build(family=family, num_layers=args.layers, kpool=args.kpool, compress_ratio=args.ratio,
                                   num_spec=args.num_spec, cache_rope_positions=family is CacheFamily.QSA)
        for batch in args.batches:
            for graphed in modes:
                logger.info("%s, batch %d, %s: %d steps", family.value, batch, "graphed" if graphed else "eager",
                            args.warmup + args.steps + args.profile_steps)
                rows.append(measure(config, batch, graphed=graphed, prompt_len=args.prompt_len, warmup=args.warmup,
                                    steps=args.steps, profile_steps=args.profile_steps, device=device))
            same = {r.tokens for r in rows if (r.family, r.batch) == (family.value, batch)}
            if len(same) != 1:
                raise SystemExit(f"{family.value}, batch {batch}: graphed steps emitted other tokens than eager steps")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_step.json").write_text(json.dumps(
        [r.json() for r in rows], indent=2))
    if args.kernels:
        first = rows[len(modes) - 1]  # the first family's first batch size's last mode: graphed where there are graphs
        print(f"kernels of a {first.family} {first.mode} step at batch {first.batch}:\n"
              f"{first.profile.kernel_table(args.kernels)}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
