"""Low-level numba intrinsics: scalar bit casts and IEEE half-precision conversion.

Bit casts are numba ``@intrinsic`` functions that emit a single LLVM ``bitcast``; they let
kernels move between a float32 and its uint32 bit pattern without touching memory.

``f16_bits_to_f32`` converts an IEEE binary16 bit pattern to float32 exactly, using integer
operations only (no reliance on F16C or on the denormals-are-zero state of the FPU). It gives
the same bits as numpy's ``float16 -> float32`` cast (numpy ``npy_halfbits_to_floatbits``),
including the sign of zero and the payload of NaNs (a signalling NaN stays signalling).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_F32_2_POW_M24 = np.float32(2.0**-24)


@intrinsic
def f32_from_bits(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as float32 (LLVM ``trunc`` + ``bitcast``)."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        value = args[0]
        if signature.args[0].bitwidth > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif signature.args[0].bitwidth < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return sig, codegen


@intrinsic
def bits_from_f32(typingctx, value):
    """Reinterpret a float32 as its uint32 bit pattern (LLVM ``bitcast``)."""
    if value != types.float32:
        return None
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(cache=True, inline="always")
def f16_bits_to_f32_bits(h):
    """binary16 bit pattern (any integer holding 16 bits) -> binary32 bit pattern (uint32).

    Normal numbers rebias the exponent (15 -> 127); subnormals are exact products
    m * 2**-24 (a normal float32); Inf/NaN keep sign and payload.
    """
    h = np.uint32(h) & np.uint32(0xFFFF)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    man = h & np.uint32(0x3FF)
    if exp == np.uint32(0x1F):
        return sign | np.uint32(0x7F800000) | (man << np.uint32(13))
    if exp == np.uint32(0):
        if man == np.uint32(0):
            return sign
        return sign | bits_from_f32(np.float32(man) * _F32_2_POW_M24)
    return sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))


@njit(cache=True, inline="always")
def f16_bits_to_f32(h):
    """binary16 bit pattern -> float32 value (exact; see module docstring)."""
    return f32_from_bits(f16_bits_to_f32_bits(h))


@njit(cache=True, inline="always")
def load_f16(buf, i):
    """float32 value of the little-endian binary16 stored at ``buf[i:i+2]`` (uint8 array)."""
    return f16_bits_to_f32(np.uint32(buf[i]) | (np.uint32(buf[i + 1]) << np.uint32(8)))
