"""IR decoders of GGML weight blocks, for the generic matmul tiles (kernels_cpu.matmul_tiles).

One class per weight type; the layout (block size, type size, field offsets, vec_dot_type) comes
from the type table (kernels_cpu.ggml_types). ``header()`` reads a block's scales, ``segments()``
yields its values 32 at a time as int16 vectors, weights times their integer sub-block scale.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType
from llvmlite import ir

from kernels_cpu.ggml_types import QUANTIZED_TYPES, TYPES
from kernels_cpu.simd import (I8, I16, I32, bit_lanes, concat, const_vec, lanes_i8, load, load_half, shuffle,
                              splat, vec)

T_ = GGMLQuantizationType
V32I8, V32I16, V16I16 = vec(I8, 32), vec(I16, 32), vec(I16, 16)


class BlockFormat:
    """IR decoder of one GGML weight type (subclasses: one per type); ``act`` (vec_dot_type),
    ``block_elems``, ``block_bytes`` and ``at`` (field name -> byte offset) are the type table's."""

    ggml_type: GGMLQuantizationType

    def __init__(self):
        row = TYPES[self.ggml_type]
        self.act, self.block_elems, self.block_bytes = row.vec_dot_type, row.block_size, row.type_size
        self.at = {name: row.offset(name) for name, _ in row.fields}

    def header(self, b: ir.IRBuilder, p) -> dict:
        raise NotImplementedError

    def segments(self, b: ir.IRBuilder, p, h: dict, unsigned: bool = False):
        """``unsigned``: Q6_K codes without their offset of 32 (ggml_vec_dot_q6_K_q8_K)."""
        raise NotImplementedError


def _nibbles(b, v):
    """<n x i8> packed nibbles -> <2n x i8>: low nibbles in lanes 0..n-1, high nibbles after."""
    n = v.type.count
    return concat(b, b.and_(v, lanes_i8(b, 0x0F, n)), b.lshr(v, lanes_i8(b, 4, n)))


def _to_i16(b, v, offset: int = 0):
    """<32 x i8> unsigned values -> <32 x i16>, minus ``offset``."""
    v = b.zext(v, V32I16)
    return b.sub(v, ir.Constant(V32I16, [offset] * 32)) if offset else v


class Q4_0(BlockFormat):
    """block_q4_0: ``f16 d | u8 qs[16]``; q = nibble - 8 (low nibbles first); ggml_vec_dot_q4_0_q8_0."""

    ggml_type = T_.Q4_0

    def header(self, b, p):
        return {"d": load_half(b, p, self.at["d"])}

    def segments(self, b, p, h, unsigned=False):
        yield 0, _to_i16(b, _nibbles(b, load(b, p, self.at["qs"], vec(I8, 16))), 8)


class Q4_1(BlockFormat):
    """block_q4_1: ``f16 d | f16 m | u8 qs[16]``; x = d*q + m; ggml_vec_dot_q4_1_q8_1."""

    ggml_type = T_.Q4_1

    def header(self, b, p):
        return {"d": load_half(b, p, self.at["d"]), "m": load_half(b, p, self.at["m"])}

    def segments(self, b, p, h, unsigned=False):
        yield 0, _to_i16(b, _nibbles(b, load(b, p, self.at["qs"], vec(I8, 16))))


class Q5_0(BlockFormat):
    """block_q5_0: ``f16 d | u32 qh | u8 qs[16]``; bit 4 of value j = bit j of qh; q - 16."""

    ggml_type, offset = T_.Q5_0, 16

    def header(self, b, p):
        return {"d": load_half(b, p, self.at["d"])}

    def segments(self, b, p, h, unsigned=False):
        low = _nibbles(b, load(b, p, self.at["qs"], vec(I8, 16)))
        bits = bit_lanes(b, load(b, p, self.at["qh"], I32))
        if self.offset:  # q - 16 as a signed byte: low nibble, with bits 4-7 set where bit 4 of q is 0
            yield 0, b.sext(b.or_(low, b.select(bits, lanes_i8(b, 0, 32), lanes_i8(b, 0xF0, 32))), V32I16)
        else:
            yield 0, _to_i16(b, b.or_(low, b.select(bits, lanes_i8(b, 16, 32), lanes_i8(b, 0, 32))))


class Q5_1(Q5_0):
    """block_q5_1: ``f16 d | f16 m | u32 qh | u8 qs[16]``; x = d*q + m; ggml_vec_dot_q5_1_q8_1."""

    ggml_type, offset = T_.Q5_1, 0

    def header(self, b, p):
        return {"d": load_half(b, p, self.at["d"]), "m": load_half(b, p, self.at["m"])}


class Q8_0(BlockFormat):
    """block_q8_0: ``f16 d | i8 qs[32]``; ggml_vec_dot_q8_0_q8_0."""

    ggml_type = T_.Q8_0

    def header(self, b, p):
        return {"d": load_half(b, p, self.at["d"])}

    def segments(self, b, p, h, unsigned=False):
        yield 0, b.sext(load(b, p, self.at["qs"], V32I8), V32I16)


def _group_scales(b, scales16, g: int):
    """<16 x i16> scales of 16-value groups -> <32 x i16>: lanes 0-15 scale g, lanes 16-31 scale g + 1
    (a 32-value segment spans two groups)."""
    return shuffle(b, scales16, [g] * 16 + [g + 1] * 16)


def _crumbs(b, v, shift: int):
    """(v >> shift) & 3 on <32 x i8>."""
    return b.and_(b.lshr(v, lanes_i8(b, shift, 32)), lanes_i8(b, 3, 32))


class Q2_K(BlockFormat):
    """block_q2_K: ``u8 scales[16] | u8 qs[64] | f16 d | f16 dmin``; ggml_vec_dot_q2_K_q8_K.

    scales[i] = min << 4 | scale of values 16i..16i+15; value 128h + 32g + i is
    (qs[32h + i] >> 2g) & 3; x = d*scale*q - dmin*min.
    """

    ggml_type = T_.Q2_K

    def header(self, b, p):
        sc = load(b, p, self.at["scales"], vec(I8, 16))
        return {"d": load_half(b, p, self.at["d"]), "dmin": load_half(b, p, self.at["dmin"]),
                "scales": b.zext(b.and_(sc, lanes_i8(b, 0x0F, 16)), V16I16),
                "mins": b.zext(b.lshr(sc, lanes_i8(b, 4, 16)), V16I16)}

    def segments(self, b, p, h, unsigned=False):
        for half in range(2):
            v = load(b, p, self.at["qs"] + 32 * half, V32I8)
            for g in range(4):
                yield 128 * half + 32 * g, b.mul(_to_i16(b, _crumbs(b, v, 2 * g)),
                                                 _group_scales(b, h["scales"], 8 * half + 2 * g))


class Q3_K(BlockFormat):
    """block_q3_K: ``u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d``; ggml_vec_dot_q3_K_q8_K.

    Sixteen 6-bit scales s_i (minus 32): low 4 bits in the nibbles of bytes 0..7 (s_0..s_7 low
    nibbles, s_8..s_15 high nibbles), bits 4-5 at bit 2*(i//4) of byte 8 + i%4. Value
    128h + 32g + i: low 2 bits (qs[32h + i] >> 2g) & 3, minus 4 unless bit 4h+g of hmask[i].
    """

    ggml_type = T_.Q3_K

    def header(self, b, p):
        sc = self.at["scales"]
        low = _nibbles(b, load(b, p, sc, vec(I8, 8)))  # <16 x i8>: bytes 0..7 low, then high nibbles
        high = shuffle(b, load(b, p, sc + 8, vec(I8, 4)), [0, 1, 2, 3] * 4)
        high = b.and_(b.lshr(high, const_vec(I8, [0] * 4 + [2] * 4 + [4] * 4 + [6] * 4)), lanes_i8(b, 3, 16))
        s = b.or_(low, b.shl(high, lanes_i8(b, 4, 16)))
        scales = b.sub(b.zext(s, V16I16), ir.Constant(V16I16, [32] * 16))
        return {"d": load_half(b, p, self.at["d"]), "scales": scales, "hmask": load(b, p, self.at["hmask"], V32I8)}

    def segments(self, b, p, h, unsigned=False):
        for half in range(2):
            v = load(b, p, self.at["qs"] + 32 * half, V32I8)
            for g in range(4):
                hbit = b.and_(b.lshr(h["hmask"], lanes_i8(b, 4 * half + g, 32)), lanes_i8(b, 1, 32))
                q = b.or_(_crumbs(b, v, 2 * g), b.shl(hbit, lanes_i8(b, 2, 32)))  # low + 4*hbit, 0..7
                yield 128 * half + 32 * g, b.mul(_to_i16(b, q, 4), _group_scales(b, h["scales"], 8 * half + 2 * g))


class Q4_K(BlockFormat):
    """block_q4_K: ``f16 d | f16 dmin | u8 scales[12] | u8 qs[128]``; ggml_vec_dot_q4_K_q8_K.

    Eight sub-blocks of 32 with 6-bit (scale, min) packed as in dequant.scale_min_k4; sub-block
    j is the low (j even) or high (j odd) nibbles of qs[32*(j//2):]; x = d*scale*q - dmin*min.
    """

    ggml_type = T_.Q4_K

    def header(self, b, p):
        # SWAR on the 12 scale bytes as three little-endian words: words holding scales 0-3, 4-7
        # and mins 0-3, 4-7, one per byte (scalar scales keep LLVM's int16 pmaddwd pattern intact)
        u0, u1, u2 = (load(b, p, self.at["scales"] + 4 * i, I32) for i in range(3))
        c = lambda v: ir.Constant(I32, v)  # noqa: E731
        low6, low4, top2 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
        sc_lo = b.and_(u0, low6)
        sc_hi = b.or_(b.and_(u2, low4), b.shl(b.and_(b.lshr(u0, c(6)), top2), c(4)))
        mn_lo = b.and_(u1, low6)
        mn_hi = b.or_(b.and_(b.lshr(u2, c(4)), low4), b.shl(b.and_(b.lshr(u1, c(6)), top2), c(4)))
        scales = [b.trunc(b.lshr(word, c(8 * k)), I16) for word in (sc_lo, sc_hi) for k in range(4)]
        scales = [b.and_(v, ir.Constant(I16, 0xFF)) for v in scales]
        mins = b.zext(concat(b, b.bitcast(mn_lo, vec(I8, 4)), b.bitcast(mn_hi, vec(I8, 4))), vec(I16, 8))
        return {"d": load_half(b, p, self.at["d"]), "dmin": load_half(b, p, self.at["dmin"]), "scales": scales,
                "mins": shuffle(b, mins, [j // 2 for j in range(16)])}  # min j pairs with bsums 2j, 2j+1

    def segments(self, b, p, h, unsigned=False):
        for pair in range(4):  # sub-blocks 2*pair (low nibbles) and 2*pair + 1 (high nibbles)
            v = load(b, p, self.at["qs"] + 32 * pair, V32I8)
            for j, q in ((2 * pair, b.and_(v, lanes_i8(b, 0x0F, 32))), (2 * pair + 1, b.lshr(v, lanes_i8(b, 4, 32)))):
                if "qh" in h:  # Q5_K: bit 4 of value 32j + i is bit j of qh[i]
                    q = b.or_(q, b.shl(b.and_(b.lshr(h["qh"], lanes_i8(b, j, 32)), lanes_i8(b, 1, 32)),
                                       lanes_i8(b, 4, 32)))
                yield 32 * j, b.mul(_to_i16(b, q), splat(b, h["scales"][j], 32))


class Q5_K(Q4_K):
    """block_q5_K: ``f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]``; as Q4_K plus
    bit 4 of value 32j + i = bit j of qh[i]; ggml_vec_dot_q5_K_q8_K."""

    ggml_type = T_.Q5_K

    def header(self, b, p):
        return {**super().header(b, p), "qh": load(b, p, self.at["qh"], V32I8)}


class Q6_K(BlockFormat):
    """block_q6_K: ``u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d``; ggml_vec_dot_q6_K_q8_K.

    Value 128h + 32g + i: low 4 bits from ql[64h + 32(g%2) + i] (low nibble if g < 2),
    bits 4-5 = (qh[32h + i] >> 2g) & 3; q - 32 (q itself when ``unsigned``), times
    scales[(128h + 32g + i) // 16].
    """

    ggml_type = T_.Q6_K

    def header(self, b, p):
        scales = b.sext(load(b, p, self.at["scales"], vec(I8, 16)), V16I16)
        return {"d": load_half(b, p, self.at["d"]), "scales": scales}

    def segments(self, b, p, h, unsigned=False):
        for half in range(2):
            qh = load(b, p, self.at["qh"] + 32 * half, V32I8)
            ql = [load(b, p, self.at["ql"] + 64 * half + 32 * k, V32I8) for k in range(2)]
            for g in range(4):
                low = ql[g % 2]
                low = b.and_(low, lanes_i8(b, 0x0F, 32)) if g < 2 else b.lshr(low, lanes_i8(b, 4, 32))
                q = b.or_(low, b.shl(_crumbs(b, qh, 2 * g), lanes_i8(b, 4, 32)))
                yield 128 * half + 32 * g, b.mul(_to_i16(b, q, 0 if unsigned else 32),
                                                 _group_scales(b, h["scales"], 8 * half + 2 * g))


FORMATS = {t: globals()[t.name]() for t in QUANTIZED_TYPES if t.name in globals()}  # the decoder class named after each quantized type that has one (the I-quants have their own kernels)
