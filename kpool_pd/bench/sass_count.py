"""Static instruction counts of the kpool compression kernel, compiled for an H200 (sm_90) on any
machine: no GPU is needed, Triton compiles to a cubin and its bundled ``nvdisasm`` lists the SASS.

    python -m kpool_pd.bench.sass_count [--block-p 8,16] [--warps 4] [--pools 262144]

For each launch shape it prints the registers, the SASS instructions of one thread, the most frequent
opcodes, and what the whole launch issues (warp instructions for ``--pools`` pools) with the time that
takes at four warp instructions a cycle on each of the H200's 132 SMs at 1.98 GHz: the floor set by
instruction issue, before any byte waits. The counts are the compiler's (the Triton installed here),
which may differ from the device's by a few percent.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kpool_pd.bench.arguments import bench_parser, count, counts
from kpool_pd.kernels.dispatch import INTERPRET_ENV, interpreting
from kpool_pd.kernels.kpool_compress.triton import _compress_kernel
from kpool_pd.kernels.triton_helpers import launch_options

H200 = GPUTarget("cuda", 90, 32)
H200_SMS = 132
H200_BOOST_HZ = 1.98e9
ISSUE_PER_SM_CYCLE = 4  # one warp instruction a cycle from each of an SM's four schedulers
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SIGNATURE = {"k_ptr": "*bf16", "g_ptr": "*bf16", "ape_ptr": "*fp32", "q_ptr": "*u8", "scale_ptr": "*fp32",
             "pools": "i32", "pool_stride": "i32", "slot_stride": "i32", "BLOCK_P": "constexpr",
             "KPOOL": "constexpr", "SOFTMAX": "constexpr", "ROUND_SCALE": "constexpr", "PRECISE_EXP": "constexpr"}
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)", re.M)


@dataclass(frozen=True)
class SassCount:
    block_p: int
    warps: int
    registers: int
    per_thread: int
    opcodes: tuple[tuple[str, int], ...]

    def issue_floor_us(self, pools: int) -> float:
        """Microseconds the launch over ``pools`` pools needs to issue its warp instructions."""
        warp_instructions = triton.cdiv(pools, self.block_p) * self.warps * self.per_thread
        return warp_instructions / (H200_SMS * ISSUE_PER_SM_CYCLE * H200_BOOST_HZ) * 1e6


def count_compress(block_p: int, warps: int, kpool: int = 4) -> SassCount:
    """Compile the softmax compression (round_scale, precise exp) for sm_90 and count its SASS."""
    constants = {"BLOCK_P": block_p, "KPOOL": kpool, "SOFTMAX": True, "ROUND_SCALE": True, "PRECISE_EXP": True}
    kernel = triton.compile(ASTSource(_compress_kernel, SIGNATURE, constants), target=H200,
                            options={"num_warps": warps, **launch_options()})
    with tempfile.TemporaryDirectory(prefix="kpool-pd-sass-") as tmp:
        cubin = Path(tmp, "kernel.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        usage = _tool("cuobjdump", "--dump-resource-usage", str(cubin))
        sass = _tool("nvdisasm", str(cubin))
    registers = re.search(r"REG:(\d+)", usage)
    if registers is None:
        raise RuntimeError(f"cuobjdump printed no register count:\n{usage}")
    opcodes = collections.Counter(_INSTRUCTION.findall(sass))
    return SassCount(block_p, warps, int(registers.group(1)), sum(opcodes.values()), tuple(opcodes.most_common(8)))


def _tool(name: str, *args: str) -> str:
    proc = subprocess.run([str(TOOLS / name), *args], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("python -m kpool_pd.bench.sass_count", __doc__)
    parser.add_argument("--block-p", type=counts, default=[8, 16], help="pools a program, comma-separated")
    parser.add_argument("--warps", type=counts, default=[4], help="warps a program, comma-separated")
    parser.add_argument("--pools", type=count, default=262_144, help="pools of the launch the floor is for")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if interpreting():
        parser.error(f"{INTERPRET_ENV} is set: the kernels are interpreted and nothing compiles; run without it")
    print(f"kpool compression (softmax, kpool 4) for sm_90, Triton {triton.__version__}; "
          f"issue floor for {args.pools:,} pools at 4 warp instructions a cycle, 132 SMs, 1.98 GHz")
    print(f"{'BLOCK_P':>7} {'warps':>5} {'regs':>4} {'SASS/thread':>11} {'floor us':>8}  most frequent")
    for block_p in args.block_p:
        for warps in args.warps:
            result = count_compress(block_p, warps)
            common = " ".join(f"{op} {n}" for op, n in result.opcodes)
            print(f"{block_p:>7} {warps:>5} {result.registers:>4} {result.per_thread:>11} "
                  f"{result.issue_floor_us(args.pools):>8.1f}  {common}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
