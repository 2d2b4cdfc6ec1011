"""IR decoders of the non-linear 4-bit weight blocks IQ4_NL, IQ4_XS and MXFP4, for the generic
matmul tiles (kernels_cpu.matmul_tiles; the interface is matmul_decoders.BlockFormat's).

Each is a Q4_0-style nibble unpack followed by a 16-entry table lookup (x86 vpshufb ymm, the
table in both 128-bit lanes), as the AVX2 branches of ggml_vec_dot_iq4_nl_q8_0 /
ggml_vec_dot_iq4_xs_q8_K / ggml_vec_dot_mxfp4_q8_0 do. The tables (kvalues_iq4nl,
kvalues_mxfp4) are read from gguf.quants.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL
from gguf.quants import MXFP4 as _GGUF_MXFP4
from llvmlite import ir

from kernels_cpu.matmul_decoders import V32I16, BlockFormat, _nibbles
from kernels_cpu.simd import (
    F32,
    I8,
    I16,
    I32,
    _x86_call,
    const_vec,
    load,
    load_half,
    splat,
    target_features,
    vec,
)

T_ = GGMLQuantizationType
KVALUES_IQ4NL = tuple(_GGUF_IQ4_NL.kvalues)  # int8 codes of IQ4_NL / IQ4_XS
KVALUES_MXFP4 = tuple(_GGUF_MXFP4.kvalues)  # E2M1 values doubled (the scale is halved)


HAS_PSHUFB = "+avx2" in target_features()


def lookup16(b: ir.IRBuilder, table, idx, native: bool = HAS_PSHUFB):
    """<32 x i8> idx (values 0..15) -> <32 x i8> table[idx]: x86 vpshufb ymm with AVX2
    (``native``), else a compare-and-select per table entry, which LLVM lowers on any CPU."""
    if native:
        return _x86_call(b, "llvm.x86.avx2.pshuf.b", [const_vec(I8, [v & 0xFF for v in table] * 2), idx])
    out = ir.Constant(idx.type, [0] * idx.type.count)
    for k, v in enumerate(table):
        hit = b.icmp_unsigned("==", idx, ir.Constant(idx.type, [k] * idx.type.count))
        out = b.select(hit, ir.Constant(idx.type, [v & 0xFF] * idx.type.count), out)
    return out


def e8m0_half(b: ir.IRBuilder, e):
    """float32 of an e8m0 exponent byte (i8, or each lane of <n x i8>) halved, exactly as
    ggml_e8m0_to_fp32_half: bits 0x00200000 << e for e < 2, else (e - 1) << 23."""
    n = e.type.count if isinstance(e.type, ir.VectorType) else 0
    i32, f32 = (vec(I32, n), vec(F32, n)) if n else (I32, F32)

    def c(v):
        return ir.Constant(i32, [v] * n) if n else ir.Constant(I32, v)

    e32 = b.zext(e, i32)
    small = b.shl(c(0x00200000), e32)
    big = b.shl(b.sub(e32, c(1)), c(23))
    return b.bitcast(b.select(b.icmp_unsigned("<", e32, c(2)), small, big), f32)


class IQ4_NL(BlockFormat):
    """block_iq4_nl: ``f16 d | u8 qs[16]``; value j < 16 is kvalues_iq4nl[qs[j] & 0xF], j + 16
    kvalues_iq4nl[qs[j] >> 4]; ggml_vec_dot_iq4_nl_q8_0."""

    ggml_type = T_.IQ4_NL
    table = KVALUES_IQ4NL

    def header(self, b, p):
        return {"d": load_half(b, p, self.at["d"])}

    def segments(self, b, p, h, unsigned=False):
        yield 0, b.sext(lookup16(b, self.table, _nibbles(b, load(b, p, self.at["qs"], vec(I8, 16)))), V32I16)


class MXFP4(IQ4_NL):
    """block_mxfp4: ``u8 e | u8 qs[16]``; as IQ4_NL with kvalues_mxfp4 and the scale
    GGML_E8M0_TO_FP32_HALF(e); ggml_vec_dot_mxfp4_q8_0."""

    ggml_type = T_.MXFP4
    table = KVALUES_MXFP4

    def header(self, b, p):
        return {"d": e8m0_half(b, load(b, p, self.at["e"], I8))}


class IQ4_XS(BlockFormat):
    """block_iq4_xs: ``f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128]``; ggml_vec_dot_iq4_xs_q8_K.

    Sub-block j (32 values) has scale ls_j - 32, ls_j = (scales_l[j/2] >> 4(j%2)) & 0xF |
    ((scales_h >> 2j) & 3) << 4; its values are the IQ4_NL codes of qs[16j..16j+15]."""

    ggml_type = T_.IQ4_XS

    def header(self, b, p):
        sh = b.zext(load(b, p, self.at["scales_h"], I16), I32)
        sl = b.zext(load(b, p, self.at["scales_l"], I32), I32)
        scales = []
        for j in range(8):
            low = b.and_(b.lshr(sl, ir.Constant(I32, 8 * (j // 2) + 4 * (j % 2))), ir.Constant(I32, 0xF))
            high = b.shl(b.and_(b.lshr(sh, ir.Constant(I32, 2 * j)), ir.Constant(I32, 3)), ir.Constant(I32, 4))
            scales.append(b.trunc(b.sub(b.or_(low, high), ir.Constant(I32, 32)), I16))
        return {"d": load_half(b, p, self.at["d"]), "scales": scales}

    def segments(self, b, p, h, unsigned=False):
        for j in range(8):
            q = lookup16(b, KVALUES_IQ4NL, _nibbles(b, load(b, p, self.at["qs"] + 16 * j, vec(I8, 16))))
            yield 32 * j, b.mul(b.sext(q, V32I16), splat(b, h["scales"][j], 32))


FORMATS = {cls.ggml_type: cls() for cls in (IQ4_NL, IQ4_XS, MXFP4)}
