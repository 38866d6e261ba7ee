"""Triton helpers that the ops' kernels share: launch options, and bit-exact conversions.

Every conversion here works on the bits, so a compiled run and Triton's CPU interpreter give the
bytes that torch's own casts give (the interpreter's fp32 -> bf16 cast truncates and its fp8 cast
misrounds, so neither is used). Each helper names its input and output in its docstring.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.fp8 import FP8_MAX

try:  # grid dependency control (programmatic dependent launch), in the Triton releases that have it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: kernels launch without it
    gdc_launch_dependents = gdc_wait = None

FP8_LIMIT = tl.constexpr(FP8_MAX)  # e4m3's largest finite value, as a constant of the kernels


def launch_options() -> dict:
    """Compile options of every kernel that must reproduce its reference's fp32 rounding: no fused
    multiply-add (the references round each product and each sum)."""
    return {"enable_fp_fusion": False}


def pdl_available() -> bool:
    """Programmatic dependent launch works: a Triton that has it, compiled kernels (not the interpreter) and a
    GPU of compute capability 9.0 or newer."""
    from kpool_pd.kernels.dispatch import interpreting

    return (gdc_wait is not None and not interpreting() and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


@triton.jit
def round_to_bf16(x):
    """fp32 -> fp32 holding the nearest-even bf16 value; NaN stays NaN (the GPU's arithmetic NaN,
    0x7FFFFFFF, would otherwise carry into the sign bit)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return tl.where(x != x, x, (bits & 0xFFFF0000).to(tl.float32, bitcast=True))


@triton.jit
def bf16_bits_to_f32(bits):
    """int16 bit patterns of bf16 -> their exact fp32 values."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 -> int16 bit pattern of the nearest-even bf16; NaN -> 0x7FFF (torch's own casts write other NaN
    bits on other paths: 0xFFFF vectorised on CPU, 0x7FC0 scalar; a NaN is compared as a NaN)."""
    rounded = round_to_bf16(x).to(tl.uint32, bitcast=True) >> 16
    rounded = tl.where(x != x, 0x7FFF, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def encode_e4m3(v):
    """fp32 with |v| <= 448 -> float8_e4m3fn code as uint8, rounded to nearest even."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)  # 3 mantissa bits, exponent bias 7
    scaled = mag.to(tl.float32, bitcast=True) * 512.0  # subnormals: multiples of 2**-9
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.uint32)  # round to an integer, nearest even
    code = tl.where(mag >= 0x3C800000, normal, subnormal)  # 0x3C800000 = 2**-6, the least normal
    return (code | sign).to(tl.uint8)


@triton.jit
def f32_to_e4m3_bits(x):
    """fp32 -> uint8 e4m3 code: clamp to [-448, 448], nearest even (NaN -> 0x7F with its sign, as torch)."""
    clamped = tl.minimum(tl.maximum(x, -FP8_LIMIT), FP8_LIMIT)
    nan_code = 0x7F | ((x.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.int32)
    return tl.where(x != x, nan_code, encode_e4m3(clamped).to(tl.int32)).to(tl.uint8)


@triton.jit
def decode_e4m3(code):
    """float8_e4m3fn code (uint8) -> its exact fp32 value (finite codes)."""
    bits = code.to(tl.uint32)
    sign = (bits & 0x80) << 24
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2**-9
    return tl.where(exponent == 0, tl.where(sign != 0, -subnormal, subnormal), normal)
