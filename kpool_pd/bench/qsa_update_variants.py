"""The QSA decode update's launch candidates side by side on one H200: for each, the time of one call a CUDA graph
replay after an L2 flush (median of --reps), in --runs runs in a row on the same inputs, beside the public op's
default and an empty kernel's launch floor; each candidate's bytes checked against the reference first.

    PYTHONPATH=$PWD python3 -m kpool_pd.bench.qsa_update_variants --device cuda

The candidates are both grids of ``kpool_pd.kernels.qsa_update.launch``: the two launches over the work items
(bench/kernels.py's decode variants, ``1/1w`` the former default) and the one launch a program per request
(``per request ...``). The case is kpool_pd/bench/kernels.py's "qsa forward update (decode), 3 drafts" (256
requests x 4 tokens, r 4, C 8, one head, bf16 rows, a cos/sin table of 2**20 positions), its metadata carrying
the host counts that the engine's builder sets (so the default is the engine's), with the rings filled with
finite keys and packed positions so that the straddling groups read real values. Prints the table last; exits 1
when a candidate's ring or compressed bytes differ from the torch reference's on the same device (its times are
still shown).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kpool_pd.bench.arguments import bench_parser, count  # noqa: E402
from kpool_pd.bench.qsa_cases import POSITION_RANGE, QSA_DECODE_VARIANTS, qsa_batch  # noqa: E402
from kpool_pd.bench.timing import L2_BYTES, time_graph  # noqa: E402
from kpool_pd.kernels import build_qsa_metadata, qsa_forward_update  # noqa: E402
from kpool_pd.kernels.qsa_metadata import split_uniform_decodes  # noqa: E402
from kpool_pd.kernels.qsa_rope import RopeCache  # noqa: E402
from kpool_pd.kernels.qsa_update import ref as update_ref  # noqa: E402
from kpool_pd.kernels.qsa_update.launch import UpdateGrid, UpdateLaunch, default_update_launch  # noqa: E402
from kpool_pd.kernels.qsa_update.triton import qsa_forward_update_triton  # noqa: E402
from kpool_pd.kvcache import INDEX_HEAD_DIM, qsa_ring_capacity  # noqa: E402

TARGET_US = 10.0
PER_REQUEST_VARIANTS = (UpdateLaunch(grid=UpdateGrid.REQUESTS, block=1, num_warps=1),
                        UpdateLaunch(grid=UpdateGrid.REQUESTS, block=2, num_warps=1),
                        UpdateLaunch(grid=UpdateGrid.REQUESTS, block=1, num_warps=2),
                        UpdateLaunch(grid=UpdateGrid.REQUESTS, block=1, num_warps=1, pdl=False))
# kpool_pd/bench/kernels.py's launch variants of the same case (two launches), then the one-launch grid's
CANDIDATES = QSA_DECODE_VARIANTS + PER_REQUEST_VARIANTS
ROPE = dict(rotary_dim=64, theta=10000.0, section=(12, 10, 10))


@triton.jit
def _empty_kernel(out_ptr, FLAG: tl.constexpr):
    # out: [1] int32, written only when FLAG (never here): a launch that does nothing, the floor of a flushed call
    if FLAG:
        tl.store(out_ptr, 1)


@dataclass
class DecodeCase:
    """The inputs of one decode step's update, kept as first made (``reset`` puts them back)."""

    keys: torch.Tensor  # [T, 1, D] bf16
    positions: torch.Tensor  # [T, 3] int64
    meta: object
    ring: torch.Tensor  # [B, C, 1, D + 12] bf16
    compressed: torch.Tensor  # [num_blocks, block_size / r, 1, D] bf16
    weight: torch.Tensor  # [D] fp32
    rope_cache: RopeCache
    first_ring: torch.Tensor
    first_compressed: torch.Tensor

    def reset(self) -> None:
        self.ring.copy_(self.first_ring)
        self.compressed.copy_(self.first_compressed)

    def op_kwargs(self) -> dict:
        return dict(eps=1e-6, cache_rope_positions=True, rope_cache=self.rope_cache, **ROPE)


def make_case(device: torch.device, requests: int = 256, q_len: int = 4, r: int = 4, num_spec: int = 3,
              block_size: int = 64) -> DecodeCase:
    qsl, seq, table, rings = qsa_batch(device, requests, q_len, 2 * block_size, r, block_size)
    cap = qsa_ring_capacity(r, num_spec)
    tokens = requests * q_len
    gen = torch.Generator(device=device).manual_seed(8)
    meta = build_qsa_metadata(qsl, seq, table, rings, compress_ratio=r, ring_capacity=cap, block_size=block_size,
                              num_tokens=tokens)
    split = split_uniform_decodes(qsl.cpu(), seq.cpu(), decode_threshold=1 + num_spec)  # as the engine's builder
    meta = dataclasses.replace(meta, split=split)
    keys = torch.randn(tokens, 1, INDEX_HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    positions = torch.randint(0, POSITION_RANGE, (tokens, 3), generator=gen, device=device)
    compressed = torch.zeros(table.numel(), block_size // r, 1, INDEX_HEAD_DIM, dtype=torch.bfloat16, device=device)
    ring = torch.zeros(requests, cap, 1, INDEX_HEAD_DIM + 12, dtype=torch.bfloat16, device=device)
    ring[..., :INDEX_HEAD_DIM].copy_(torch.randn(requests, cap, 1, INDEX_HEAD_DIM, generator=gen, device=device))
    ring[..., INDEX_HEAD_DIM:].view(torch.int64).copy_(
        torch.randint(0, POSITION_RANGE, (requests, cap, 1, 3), generator=gen, device=device))
    weight = torch.randn(INDEX_HEAD_DIM, generator=gen, device=device)
    rope_cache = RopeCache.build(POSITION_RANGE, device=device, **{k: ROPE[k] for k in ("rotary_dim", "theta")})
    return DecodeCase(keys, positions, meta, ring, compressed, weight, rope_cache, ring.clone(), compressed.clone())


def candidate_calls(case: DecodeCase) -> dict[str, Callable[[], None]]:
    """By label: the public op (its default launch), each candidate launch of the kernels alone."""
    r, block_size = case.meta.compress_ratio, case.meta.block_size
    default = default_update_launch(metadata=case.meta, device=case.keys.device)
    calls = {f"default (public op): {default.label}": lambda: qsa_forward_update(
        case.keys, case.positions, case.meta, case.ring, case.compressed, case.weight, compress_ratio=r,
        block_size=block_size, **case.op_kwargs())}
    for launch in CANDIDATES:
        calls[launch.label] = (lambda launch=launch: qsa_forward_update_triton(
            case.keys, case.positions, case.meta, case.ring, case.compressed, case.weight, launch=launch,
            **case.op_kwargs()))
    return calls


def same_bytes_as_reference(case: DecodeCase, calls: dict[str, Callable[[], None]]) -> dict[str, bool]:
    case.reset()
    update_ref.qsa_forward_update(case.keys, case.positions, case.meta, case.ring, case.compressed, case.weight,
                                  compress_ratio=case.meta.compress_ratio, block_size=case.meta.block_size,
                                  **case.op_kwargs())
    want_ring, want_compressed = case.ring.clone(), case.compressed.clone()
    same = {}
    for label, call in calls.items():
        case.reset()
        call()
        torch.cuda.synchronize()
        same[label] = bool(torch.equal(case.ring.view(torch.int16), want_ring.view(torch.int16))
                           and torch.equal(case.compressed.view(torch.int16), want_compressed.view(torch.int16)))
    case.reset()
    return same


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python3 -m kpool_pd.bench.qsa_update_variants", __doc__)
    parser.add_argument("--device", default="cuda", help="a CUDA device (the default: cuda)")
    parser.add_argument("--reps", type=count, default=200, help="timed replays per candidate and run (median)")
    parser.add_argument("--runs", type=count, default=3, help="runs in a row, every candidate in each")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type != "cuda" or not torch.cuda.is_available():
        print(f"bench qsa_update_variants needs a CUDA device, got {args.device!r}", file=sys.stderr)
        return 2
    torch.cuda.set_device(device)
    case = make_case(device)
    calls = candidate_calls(case)
    same = same_bytes_as_reference(case, calls)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    timed = {"empty kernel (launch floor)": lambda: _empty_kernel[(1,)](flag, FLAG=False), **calls}
    flush = torch.empty(4 * L2_BYTES, dtype=torch.uint8, device=device)
    times: dict[str, list[float]] = {label: [] for label in timed}
    steady = {label: time_graph(call, flush=None, reps=args.reps, calls=32) / 32 for label, call in timed.items()}
    for _ in range(args.runs):
        for label, call in timed.items():
            times[label].append(time_graph(call, flush=flush, reps=args.reps))
    runs = " ".join(f"{f'run {k + 1}':>7}" for k in range(args.runs))
    lines = [f"QSA decode update, 256 requests x 4 tokens, cos/sin table, on {torch.cuda.get_device_name(device)}: "
             f"us a call, 1 call a graph replay after an L2 flush (median of {args.reps}), {args.runs} runs in a row; "
             f"32 calls in a graph, a call, once",
             f"{'candidate':<40} {runs} {'worst':>7} {f'all <= {TARGET_US:g}':>10} {'graph32':>8}  bytes"]
    for label in timed:
        met = "yes" if max(times[label]) <= TARGET_US else "NO"
        check = "-" if label not in same else ("same" if same[label] else "DIFFER")
        lines.append(f"{label:<40} " + " ".join(f"{t:7.2f}" for t in times[label])
                     + f" {max(times[label]):7.2f} {met:>10} {steady[label]:8.2f}  {check}")
    print("\n".join(lines))
    bad = [label for label, ok in same.items() if not ok]
    if bad:
        print(f"bytes differ from the reference: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
