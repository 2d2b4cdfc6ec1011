"""Scalar float32 arithmetic that reproduces ggml's CPU build operation for operation.

``fma`` is a fused multiply-add with a single rounding (LLVM ``llvm.fma.f32``: the FMA
instruction where the CPU has one, a correctly rounded libm call otherwise), as GCC emits for
ggml's ``_mm512_fmadd_ps`` intrinsics and for the ``a*b + c`` expressions it contracts.
Plain ``a * b + c`` in numba is two roundings (numba does not contract without fastmath).

``expf``/``cosf``/``sinf``/``tanhf``/``powf`` of float32 arguments inside numba code call the C
library (LLVM lowers ``math.exp`` etc. on float32 to ``expf`` ...), i.e. glibc's correctly
rounded-or-nearly versions that ggml calls; numpy's own SIMD versions differ in the last bit,
so kernels that must match ggml use ``math.*`` on float32 values, never ``np.exp`` on arrays.
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_F32 = ir.FloatType()


@intrinsic
def fma(typingctx, a, b, c):
    """float32 a * b + c rounded once (llvm.fma.f32)."""
    if not all(t == types.float32 for t in (a, b, c)):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_F32, [_F32, _F32, _F32])
        return builder.call(builder.module.declare_intrinsic("llvm.fma", [_F32], fnty), args)

    return sig, codegen


@njit(cache=True, inline="always")
def hsum16(v, o):
    """Sum of the 16 float32 lanes v[o:o+16] in the order of GCC's _mm512_reduce_add_ps:
    halves added lane-wise (8, then 4, 2, 1 lanes): ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) with
    a_i = v_i + v_(i+8)."""
    a0 = v[o] + v[o + 8]
    a1 = v[o + 1] + v[o + 9]
    a2 = v[o + 2] + v[o + 10]
    a3 = v[o + 3] + v[o + 11]
    a4 = v[o + 4] + v[o + 12]
    a5 = v[o + 5] + v[o + 13]
    a6 = v[o + 6] + v[o + 14]
    a7 = v[o + 7] + v[o + 15]
    return ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


# ggml_v_expf constants (vec.h, "adapted from arm limited optimized routine")
_EXP_SHIFT = np.float32(float.fromhex("0x1.8p23"))
_EXP_LOG2E = np.float32(float.fromhex("0x1.715476p+0"))
_EXP_LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))
_EXP_LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_C1 = np.float32(float.fromhex("0x1.ffffecp-1"))
_EXP_C2 = np.float32(float.fromhex("0x1.fffdb6p-2"))
_EXP_C3 = np.float32(float.fromhex("0x1.555e66p-3"))
_EXP_C4 = np.float32(float.fromhex("0x1.573e2ep-5"))
_EXP_C5 = np.float32(float.fromhex("0x1.0e4020p-7"))
_ONE = np.float32(1.0)


@intrinsic
def _f64_from_bits(typingctx, bits):
    """Reinterpret an int64 as float64 (LLVM bitcast)."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@njit(cache=True, inline="always")
def v_expf(x):
    """exp(x) for float32 x exactly as one lane of ggml_v_expf (vec.h, AVX-512 version).

    n = round(x / ln 2) via the 1.5 * 2**23 shift trick; b = x - n ln2 (two-part ln2, fused);
    j = degree-5 polynomial in b (Horner pairs with FMA); result = j * 2**n rounded once
    (_mm512_scalef_ps; here an exact float64 product rounded to float32); |n| > 192 gives 0
    (n <= 0) or inf. Branch-free, so loops over it vectorize.
    """
    z = fma(x, _EXP_LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = fma(-n, _EXP_LN2_LO, fma(-n, _EXP_LN2_HI, x))
    u = b * b
    j = fma(fma(fma(_EXP_C5, b, _EXP_C4), u, fma(_EXP_C3, b, _EXP_C2)), u, fma(_EXP_C1, b, _ONE))
    e = np.int64(min(max(n, np.float32(-192.0)), np.float32(192.0)))
    res = np.float32(np.float64(j) * _f64_from_bits((e + np.int64(1023)) << np.int64(52)))
    big = np.float32(0.0) if n <= np.float32(0.0) else np.float32(np.inf)
    return big if abs(n) > np.float32(192.0) else res
