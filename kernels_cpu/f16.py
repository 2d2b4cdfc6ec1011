"""IEEE half-precision conversions for numba code.

numba has no float16 type on the CPU, so f16 data (KV cache, F16 weights, fp16 block scales)
travels as ``uint16`` and is converted with these intrinsics, which emit LLVM's ``fpext half``
and ``fptrunc ... to half`` (F16C ``vcvtph2ps``/``vcvtps2ph`` on x86, ``fcvt`` on arm64).
Both are exact IEEE conversions: ``f16_to_f32`` equals ``np.float16 -> np.float32`` and
``f32_to_f16`` rounds to nearest even like ``np.float32.astype(np.float16)``.
"""
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def f16_to_f32(typingctx, bits):
    """uint16 bit pattern of an IEEE half -> float32 (exact)."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 16:
            v = builder.trunc(v, ir.IntType(16)) if v.type.width > 16 else builder.zext(v, ir.IntType(16))
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def f32_to_f16(typingctx, value):
    """float32 (or float64) -> uint16 bit pattern of the nearest IEEE half (ties to even)."""
    if not isinstance(value, types.Float):
        return None
    sig = types.uint16(value)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen
