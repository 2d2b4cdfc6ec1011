"""Quantized matrix multiplication: out[t, r] = sum_k W[r, k] * x[t, k], bit for bit as llama.cpp's CPU backend.

x is first converted to the weight type's ``vec_dot_type`` (ggml-cpu.c ``type_traits_cpu``):

    Q4_0, Q5_0, Q8_0 -> Q8_0      Q4_1, Q5_1 -> Q8_1      Q2_K .. Q6_K -> Q8_K
    F16 -> x rounded to f16       BF16 -> x rounded to bf16       F32 -> x as is

Integer products are exact in every ggml kernel, so a result is fixed by which integer sums
become floats, the float scales they meet and the order of the float operations. For each
weight type and batch size T, llama.cpp (x86-64, AVX-512 VNNI build, CPU_REPACK and tiled
matmul on) runs one of these kernels; each ``path`` here reproduces its float structure:

VEC_DOT  ggml_vec_dot_<type>_<vec_dot_type> (arch/x86/quants.c, AVX2 code), and for Q4_0/Q5_0/
         Q8_0 batches of T >= 2 llamafile's tinyBLAS_Q0_AVX (same structure): 8 float lanes per
         output; per block lane j gets the integer sum of values 4j..4j+3 of every 32-value
         segment (times their sub-block scales) through acc = fma(d_w * d_x, lane, acc); the
         result is hsum_float_8 = ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)). Per type: Q4_1/Q5_1 add
         a fma chain of m * s; Q6_K lanes use codes 0..63 minus 32 * scale * bsums; Q4_K adds
         4 lanes of mins * bsums (scale -d_x * dmin), Q5_K a scalar fma chain of them, Q2_K puts
         them first into the same 8 lanes. Used for Q4_0..Q5_1 always, K-quants when T < 8.
TILED    tiled_run_micro_vnni_8x16 (tiled/tiled-kernel.cpp), K-quants with T >= 8 that are not
         repacked: per super-block exact totals S1 (and mins S2); r = S1 * d_w, r = fma(-dmin,
         S2, r); acc = fma(r, d_x, acc).
GEMV     ggml_gemv_{q4_K,q2_K}_8x8_q8_K (arch/x86/repack.cpp): Q4_K / Q2_K with R % 8 == 0 are
GEMM     repacked; activation rows [0, T - T % 4) (T > 3) go through the gemm, the rest through
         the gemv. Per group of values (gemv: 256; gemm: 64 for Q4_K, 128 for Q2_K) acc =
         fma(I, d_w * d_x, acc) and accm = fma(M, dmin * d_x, accm); out = acc - accm. Q4_0 with
         R % 8 == 0 is repacked too (q4_0_8x8): gemv and gemm both take acc = fma(I, d_w * d_x,
         acc) per 32-value block (GEMV here).

The kernels are LLVM vector IR generated here and called through a numba intrinsic
(``qdot_tile``): for a tile of nr weight rows x nt activation rows, each weight block is
unpacked once into 32-lane int16 "segments" (weights times their integer sub-block scale) and
multiplied with the activation segments pairwise into int32 lanes (x86 ``pmaddwd``). The
integer vectors of the tile's (r, t) pairs are then merged two by two, adding lanes that hold
partial sums of the same output (_pack_plan), down to the lanes of the path (8, 4 or 1 per
output); this also packs several outputs into one vector, and the float updates run on those
packed vectors. Only two tile shapes exist: NR x NT for T >= NT, over chunks of TC activation
rows (so the chunk stays in cache), and ND x 1 for fewer rows (decode), with the ND rows
R // ND apart (adjacent rows in one tile stream from DRAM at half the speed of one row).
Results do not depend on the tiling, so edge tiles overlap their neighbours instead of being
smaller.

On CPUs with AVX-512 VNNI (simd.HAS_VNNI) some tiles come from other generators, with the
same float operations: Q4_K (repacked) and Q6_K (tiled) from kernels_cpu.matmul_rows (one
weight row per lane), Q5_0 / Q8_0 and Q6_K on the VEC_DOT path from kernels_cpu.matmul_vnni
(vpdpbusd / vpmaddubsw + vpdpwssd straight into ggml's 8 lanes); those types take int8 quants.

Not reproduced: F32/F16/BF16 weights (tinyBLAS / ggml_vec_dot_f16 orders); they agree to
float32 rounding.

Shapes everywhere: w uint8[R, row_bytes] (GGUFFile.tensor_rows), x float32[T, K], out
float32[T, R]; per-type kernels take the quantized activations (see quantize_act).
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels_cpu import quantize_act as qa
from kernels_cpu.dequant import QuantFormatError, as_ggml_type
from kernels_cpu.f16 import f16_to_f32, f32_to_f16
from kernels_cpu.matmul_rows import Q0_ROWS, ROWS, build_rows_tile
from kernels_cpu.matmul_vnni import build_vnni_tile
from kernels_cpu.simd import (BYTE_PTR, F32, HAS_VNNI, I8, I16, I32, I64, bit_lanes, concat, const_vec,
                              f32_from_bits, fmuladd, lanes_i8, load, load_half, madd_pairs, shuffle, splat,
                              tile_function, vec)

T_ = GGMLQuantizationType
LANES = 16  # float32 / int32 lanes per accumulator (32 int16 products pairwise summed)
NR, NT = 4, 4  # prefill tile: weight rows x activation rows
TC = 64  # activation rows per prefill chunk
ND = 4  # decode tile rows, R // ND apart (adjacent rows in one tile stream from DRAM at half speed)
# Q4_K (repacked) and Q6_K with AVX-512 VNNI: tiles of 8 rows, one per lane (kernels_cpu.matmul_rows)
NR_ROWS = ROWS if HAS_VNNI else NR
NT_WIDE = 8 if HAS_VNNI else 0  # Q5_0 / Q8_0 GEMV rows tiles: 8 activation rows per weight decoding
NR_Q0 = 8 if HAS_VNNI else NR  # Q5_0 / Q8_0 with AVX-512 VNNI: 8 rows in pairs (kernels_cpu.matmul_vnni)
ND_Q6_K = 2 if HAS_VNNI else NR  # Q6_K vec_dot (T < 8) with VNNI: one row pair per tile (kernels_cpu.matmul_vnni)

ACT_Q8_0, ACT_Q8_1, ACT_Q8_K = "q8_0", "q8_1", "q8_k"

V32I8, V32I16, V16I16, V16F32 = vec(I8, 32), vec(I16, 32), vec(I16, 16), vec(F32, 16)


# ---------------------------------------------------------------------------------------------
# Weight block decoders (IR). header() reads the scales of the block at i8* p; segments()
# yields (value offset in block, <32 x i16> weight times integer sub-scale) in block order.


class BlockFormat:
    """IR decoder of one GGML weight type; subclasses give the layout (ggml-common.h)."""

    ggml_type: GGMLQuantizationType
    act: str  # vec_dot_type of the activations
    block_elems: int
    block_bytes: int

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

    ggml_type, act, block_elems, block_bytes = T_.Q4_0, ACT_Q8_0, 32, 18

    def header(self, b, p):
        return {"d": load_half(b, p, 0)}

    def segments(self, b, p, h, unsigned=False):
        yield 0, _to_i16(b, _nibbles(b, load(b, p, 2, vec(I8, 16))), 8)


class Q4_1(BlockFormat):
    """block_q4_1: ``f16 d | f16 m | u8 qs[16]``; x = d*q + m; ggml_vec_dot_q4_1_q8_1."""

    ggml_type, act, block_elems, block_bytes = T_.Q4_1, ACT_Q8_1, 32, 20

    def header(self, b, p):
        return {"d": load_half(b, p, 0), "m": load_half(b, p, 2)}

    def segments(self, b, p, h, unsigned=False):
        yield 0, _to_i16(b, _nibbles(b, load(b, p, 4, vec(I8, 16))))


class Q5_0(BlockFormat):
    """block_q5_0: ``f16 d | u32 qh | u8 qs[16]``; bit 4 of value j = bit j of qh; q - 16."""

    ggml_type, act, block_elems, block_bytes = T_.Q5_0, ACT_Q8_0, 32, 22
    qh_at, qs_at, offset = 2, 6, 16

    def header(self, b, p):
        return {"d": load_half(b, p, 0)}

    def segments(self, b, p, h, unsigned=False):
        low = _nibbles(b, load(b, p, self.qs_at, vec(I8, 16)))
        bits = bit_lanes(b, load(b, p, self.qh_at, I32))
        if self.offset:  # q - 16 as a signed byte: low nibble, with bits 4-7 set where bit 4 of q is 0
            yield 0, b.sext(b.or_(low, b.select(bits, lanes_i8(b, 0, 32), lanes_i8(b, 0xF0, 32))), V32I16)
        else:
            yield 0, _to_i16(b, b.or_(low, b.select(bits, lanes_i8(b, 16, 32), lanes_i8(b, 0, 32))))


class Q5_1(Q5_0):
    """block_q5_1: ``f16 d | f16 m | u32 qh | u8 qs[16]``; x = d*q + m; ggml_vec_dot_q5_1_q8_1."""

    ggml_type, act, block_elems, block_bytes = T_.Q5_1, ACT_Q8_1, 32, 24
    qh_at, qs_at, offset = 4, 8, 0

    def header(self, b, p):
        return {"d": load_half(b, p, 0), "m": load_half(b, p, 2)}


class Q8_0(BlockFormat):
    """block_q8_0: ``f16 d | i8 qs[32]``; ggml_vec_dot_q8_0_q8_0."""

    ggml_type, act, block_elems, block_bytes = T_.Q8_0, ACT_Q8_0, 32, 34

    def header(self, b, p):
        return {"d": load_half(b, p, 0)}

    def segments(self, b, p, h, unsigned=False):
        yield 0, b.sext(load(b, p, 2, V32I8), V32I16)


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

    ggml_type, act, block_elems, block_bytes = T_.Q2_K, ACT_Q8_K, 256, 84

    def header(self, b, p):
        sc = load(b, p, 0, vec(I8, 16))
        return {"d": load_half(b, p, 80), "dmin": load_half(b, p, 82),
                "scales": b.zext(b.and_(sc, lanes_i8(b, 0x0F, 16)), V16I16),
                "mins": b.zext(b.lshr(sc, lanes_i8(b, 4, 16)), V16I16)}

    def segments(self, b, p, h, unsigned=False):
        for half in range(2):
            v = load(b, p, 16 + 32 * half, V32I8)
            for g in range(4):
                yield 128 * half + 32 * g, b.mul(_to_i16(b, _crumbs(b, v, 2 * g)),
                                                 _group_scales(b, h["scales"], 8 * half + 2 * g))


class Q3_K(BlockFormat):
    """block_q3_K: ``u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d``; ggml_vec_dot_q3_K_q8_K.

    Sixteen 6-bit scales s_i (minus 32): low 4 bits in the nibbles of bytes 0..7 (s_0..s_7 low
    nibbles, s_8..s_15 high nibbles), bits 4-5 at bit 2*(i//4) of byte 8 + i%4. Value
    128h + 32g + i: low 2 bits (qs[32h + i] >> 2g) & 3, minus 4 unless bit 4h+g of hmask[i].
    """

    ggml_type, act, block_elems, block_bytes = T_.Q3_K, ACT_Q8_K, 256, 110

    def header(self, b, p):
        low = _nibbles(b, load(b, p, 96, vec(I8, 8)))  # <16 x i8>: bytes 0..7 low, then high nibbles
        high = shuffle(b, load(b, p, 104, vec(I8, 4)), [0, 1, 2, 3] * 4)
        high = b.and_(b.lshr(high, const_vec(I8, [0] * 4 + [2] * 4 + [4] * 4 + [6] * 4)), lanes_i8(b, 3, 16))
        s = b.or_(low, b.shl(high, lanes_i8(b, 4, 16)))
        scales = b.sub(b.zext(s, V16I16), ir.Constant(V16I16, [32] * 16))
        return {"d": load_half(b, p, 108), "scales": scales, "hmask": load(b, p, 0, V32I8)}

    def segments(self, b, p, h, unsigned=False):
        for half in range(2):
            v = load(b, p, 32 + 32 * half, V32I8)
            for g in range(4):
                hbit = b.and_(b.lshr(h["hmask"], lanes_i8(b, 4 * half + g, 32)), lanes_i8(b, 1, 32))
                q = b.or_(_crumbs(b, v, 2 * g), b.shl(hbit, lanes_i8(b, 2, 32)))  # low + 4*hbit, 0..7
                yield 128 * half + 32 * g, b.mul(_to_i16(b, q, 4), _group_scales(b, h["scales"], 8 * half + 2 * g))


class Q4_K(BlockFormat):
    """block_q4_K: ``f16 d | f16 dmin | u8 scales[12] | u8 qs[128]``; ggml_vec_dot_q4_K_q8_K.

    Eight sub-blocks of 32 with 6-bit (scale, min) packed as in dequant.scale_min_k4; sub-block
    j is the low (j even) or high (j odd) nibbles of qs[32*(j//2):]; x = d*scale*q - dmin*min.
    """

    ggml_type, act, block_elems, block_bytes = T_.Q4_K, ACT_Q8_K, 256, 144
    qs_at = 16

    def header(self, b, p):
        # SWAR on the 12 scale bytes as three little-endian words: words holding scales 0-3, 4-7
        # and mins 0-3, 4-7, one per byte (scalar scales keep LLVM's int16 pmaddwd pattern intact)
        u0, u1, u2 = (load(b, p, 4 + 4 * i, I32) for i in range(3))
        c = lambda v: ir.Constant(I32, v)  # noqa: E731
        low6, low4, top2 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
        sc_lo = b.and_(u0, low6)
        sc_hi = b.or_(b.and_(u2, low4), b.shl(b.and_(b.lshr(u0, c(6)), top2), c(4)))
        mn_lo = b.and_(u1, low6)
        mn_hi = b.or_(b.and_(b.lshr(u2, c(4)), low4), b.shl(b.and_(b.lshr(u1, c(6)), top2), c(4)))
        scales = [b.trunc(b.lshr(word, c(8 * k)), I16) for word in (sc_lo, sc_hi) for k in range(4)]
        scales = [b.and_(v, ir.Constant(I16, 0xFF)) for v in scales]
        mins = b.zext(concat(b, b.bitcast(mn_lo, vec(I8, 4)), b.bitcast(mn_hi, vec(I8, 4))), vec(I16, 8))
        return {"d": load_half(b, p, 0), "dmin": load_half(b, p, 2), "scales": scales,
                "mins": shuffle(b, mins, [j // 2 for j in range(16)])}  # min j pairs with bsums 2j, 2j+1

    def segments(self, b, p, h, unsigned=False):
        for pair in range(4):  # sub-blocks 2*pair (low nibbles) and 2*pair + 1 (high nibbles)
            v = load(b, p, self.qs_at + 32 * pair, V32I8)
            for j, q in ((2 * pair, b.and_(v, lanes_i8(b, 0x0F, 32))), (2 * pair + 1, b.lshr(v, lanes_i8(b, 4, 32)))):
                if "qh" in h:  # Q5_K: bit 4 of value 32j + i is bit j of qh[i]
                    q = b.or_(q, b.shl(b.and_(b.lshr(h["qh"], lanes_i8(b, j, 32)), lanes_i8(b, 1, 32)),
                                       lanes_i8(b, 4, 32)))
                yield 32 * j, b.mul(_to_i16(b, q), splat(b, h["scales"][j], 32))


class Q5_K(Q4_K):
    """block_q5_K: ``f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]``; as Q4_K plus
    bit 4 of value 32j + i = bit j of qh[i]; ggml_vec_dot_q5_K_q8_K."""

    ggml_type, act, block_elems, block_bytes = T_.Q5_K, ACT_Q8_K, 256, 176
    qs_at = 48

    def header(self, b, p):
        return {**super().header(b, p), "qh": load(b, p, 16, V32I8)}


class Q6_K(BlockFormat):
    """block_q6_K: ``u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d``; ggml_vec_dot_q6_K_q8_K.

    Value 128h + 32g + i: low 4 bits from ql[64h + 32(g%2) + i] (low nibble if g < 2),
    bits 4-5 = (qh[32h + i] >> 2g) & 3; q - 32 (q itself when ``unsigned``), times
    scales[(128h + 32g + i) // 16].
    """

    ggml_type, act, block_elems, block_bytes = T_.Q6_K, ACT_Q8_K, 256, 210

    def header(self, b, p):
        return {"d": load_half(b, p, 208), "scales": b.sext(load(b, p, 192, vec(I8, 16)), V16I16)}

    def segments(self, b, p, h, unsigned=False):
        for half in range(2):
            qh = load(b, p, 128 + 32 * half, V32I8)
            ql = [load(b, p, 64 * half + 32 * k, V32I8) for k in range(2)]
            for g in range(4):
                low = ql[g % 2]
                low = b.and_(low, lanes_i8(b, 0x0F, 32)) if g < 2 else b.lshr(low, lanes_i8(b, 4, 32))
                q = b.or_(low, b.shl(_crumbs(b, qh, 2 * g), lanes_i8(b, 4, 32)))
                yield 128 * half + 32 * g, b.mul(_to_i16(b, q, 0 if unsigned else 32),
                                                 _group_scales(b, h["scales"], 8 * half + 2 * g))


FORMATS = {f.ggml_type: f for f in (Q4_0(), Q4_1(), Q5_0(), Q5_1(), Q8_0(), Q2_K(), Q3_K(), Q4_K(), Q5_K(), Q6_K())}


# ---------------------------------------------------------------------------------------------
# llama.cpp's kernels ("paths"). Integer sums are exact in every kernel, so results depend only
# on which integer sums become floats, the float scales they are multiplied by and the order
# of the float operations; each path reproduces those of one llama.cpp kernel (x86-64, AVX-512
# VNNI build), see the module docstring.

VEC_DOT, TILED, GEMV, GEMM = 0, 1, 2, 3
PATH_NAMES = ("vec_dot", "tiled", "gemv", "gemm")


def _groups(fmt: BlockFormat, path: int) -> int:
    """Float updates per block: GEMM takes one per 64 (Q4_K) or 128 (Q2_K) values."""
    if path != GEMM:
        return 1
    return 4 if fmt.ggml_type == T_.Q4_K else 2


class Packed:
    """Integer or float <16 x T> vectors holding partial sums of several tile inputs ((r, t) pairs).

    ``labels[k][l] = (input, part)``: lane l of vector k holds partial ``part`` of ``input`` (its
    other lanes may hold copies). Partial j of an input at merge level m is the sum of its pair
    sums j * 2**m .. (j + 1) * 2**m - 1 (pair sum p: values 2p, 2p + 1 of every 32-value segment).
    """

    def __init__(self, vecs: list, labels: list):
        self.vecs, self.labels = vecs, labels

    def owners(self, k: int) -> list:
        return [i for i, _ in self.labels[k]]


def _pair_masks(kind: str, arg: int = 0):
    """(lo, hi) shuffle masks of one merge step over two vectors (lanes >= 16: second vector):
    result lane l = src[lo[l]] + src[hi[l]].

    "lane": within each 128-bit lane k, [a0+a1, a2+a3, b0+b1, b2+b3] of that lane (x86 vshufps);
    "block": 128-bit lanes 2j, 2j+1 of a, then of b, added (vshufi32x4); "evenodd": even plus
    odd lanes of a then of b (vpermt2d); "fold": one vector, lane l plus lane l ^ arg.
    """
    if kind == "fold":
        return list(range(LANES)), [lane ^ arg for lane in range(LANES)]
    lo = []
    for lane in range(LANES):
        k, m = divmod(lane, 4)
        if kind == "lane":
            lo.append((LANES if m >= 2 else 0) + 4 * k + 2 * (m % 2))
        elif kind == "block":
            lo.append((LANES if k >= 2 else 0) + 8 * (k % 2) + m)
        else:
            lo.append((LANES if lane >= 8 else 0) + 2 * (lane % 8))
    step = 4 if kind == "block" else 1
    return lo, [v + step for v in lo]


def _merge_labels(kind, a, c, arg=0):
    """Labels after a merge step, or None if it would add lanes of different inputs or
    partials that are not 2j and 2j + 1."""
    src = a + c
    lo, hi = _pair_masks(kind, arg)
    out = []
    for x, y in zip(lo, hi):
        (i, p), (i2, p2) = src[x], src[y]
        if i != i2 or {p, p2} != {p & ~1, p | 1}:
            return None
        out.append((i, p >> 1))
    return out


def _pack_plan(n: int, w: int):
    """How _pack merges n per-input vectors of 16 pair sums down to ``w`` partials per input
    (8: lane j sums values 4j..4j+3 of every segment, as ggml's 8 lanes; 1: the total).

    Two vectors merge with the cheapest valid step ("lane", "block", "evenodd"); a lone vector
    folds in place. Returns (steps, labels of the resulting vectors)."""
    labels = [[(i, p) for p in range(LANES)] for i in range(n)]
    steps, parts = [], LANES
    while parts > w:
        if len(labels) > 1:
            pairs = [(k, min(k + 1, len(labels) - 1)) for k in range(0, len(labels), 2)]
            for kind in ("lane", "block", "evenodd"):
                merged = [_merge_labels(kind, labels[a], labels[c]) for a, c in pairs]
                if all(merged):
                    break
            steps.append((kind, pairs))
        else:
            for s in (1, 2, 4, 8):
                merged = [_merge_labels("fold", labels[0], [], s)]
                if merged[0]:
                    break
            steps.append(("fold", s))
        assert all(merged), "no valid merge"
        labels, parts = merged, parts // 2
    return steps, labels


def _pack(b, vecs: list, w: int) -> Packed:
    """Per-input <16 x i32> vectors of pair sums -> Packed with ``w`` partials per input."""
    steps, labels = _pack_plan(len(vecs), w)
    for kind, arg in steps:
        if kind == "fold":
            lo, hi = _pair_masks(kind, arg)
            vecs = [b.add(v, shuffle(b, v, hi)) for v in vecs]
        else:
            lo, hi = _pair_masks(kind)
            vecs = [b.add(shuffle(b, vecs[a], lo, vecs[c]), shuffle(b, vecs[a], hi, vecs[c])) for a, c in arg]
    return Packed(vecs, labels)


def _as_pairs(b, v):
    """<8 x i32> -> <16 x i32> [v0, 0, v1, 0, ...]: pair sums whose pairs add up to v's lanes,
    so sums over 32-value groups pack like segment products (lane j of v: values 32j..32j+31)."""
    return b.bitcast(b.zext(v, vec(I64, 8)), vec(I32, LANES))


def _direct_mins(b, headers: list, bsums: list, nt: int, owners: list, ks: range):
    """<16 x i32> with lane l = sum over k in ``ks`` (16-value groups, by pairs k, k + 1) of
    min16[k] * bsums[k] of input owners[l] = r * nt + t: the mins term of a few groups built
    straight in an accumulator's lane order (one pmaddwd per pair of groups, operands
    permuted from all rows' mins and all activation rows' bsums; nr and nt powers of two)."""
    all_mins = [h["mins"] for h in headers]
    while len(all_mins) > 1:  # concat: rows' 16 mins side by side
        all_mins = [concat(b, all_mins[k], all_mins[k + 1]) for k in range(0, len(all_mins), 2)]
    all_bs = list(bsums)
    while len(all_bs) > 1:
        all_bs = [concat(b, all_bs[k], all_bs[k + 1]) for k in range(0, len(all_bs), 2)]
    total = None
    for k in ks[::2]:
        lanes_m = [16 * (i // nt) + k + j for i in owners for j in (0, 1)]
        lanes_b = [16 * (i % nt) + k + j for i in owners for j in (0, 1)]
        term = madd_pairs(b, shuffle(b, all_mins[0], lanes_m), shuffle(b, all_bs[0], lanes_b))
        total = term if total is None else b.add(total, term)
    return total


def _lanes(b, per_input, p: Packed, k: int):
    """<16 x float> with lane l = per_input[input of lane l of p's vector k]."""
    return shuffle(b, per_input, p.owners(k))


def _by_input(b, values: list, index: list):
    """<16 x float> with lane i = values[index[i]] (values: scalars, index: one entry per input)."""
    small = ir.Constant(vec(F32, len(values)), ir.Undefined)
    for k, v in enumerate(values):
        small = b.insert_element(small, v, ir.Constant(I32, k))
    return shuffle(b, small, index + [0] * (LANES - len(index)))


def _to_float(b, v):
    return b.sitofp(v, V16F32)


def _accumulators(fmt: BlockFormat, path: int, n: int) -> dict:
    """Accumulator name -> (labels of its packed float vectors, partials per input)."""
    if path == VEC_DOT:
        out = {"lanes": (_pack_plan(n, 8)[1], 8)}
        if fmt.ggml_type in (T_.Q4_K, T_.Q5_K):
            w = 4 if fmt.ggml_type == T_.Q4_K else 1
            out["mins"] = (_pack_plan(n, w)[1], w)
        if fmt.act == ACT_Q8_1:
            out["sum"] = ([[(i, 0) for i in range(n)] + [(n - 1, 0)] * (LANES - n)], 1)
        return out
    out = {"acc": (_pack_plan(n, 1)[1], 1)}
    if path != TILED and fmt.ggml_type in (T_.Q4_K, T_.Q2_K):  # GEMV / GEMM: the mins apart
        out["accm"] = out["acc"]
    return out


def _emit_block(b, fmt: BlockFormat, path: int, rows: dict, blk, accs: dict) -> dict:
    """IR for block ``blk`` of every (r, t) input of a tile (input i = r * nt + t): the integer
    sums, then the float updates of ``path``; returns the new accumulators (packed float
    vectors by name, laid out as _accumulators says)."""
    nr, nt = len(rows["w"]), len(rows["xq"])
    inputs = [(r, t) for r in range(nr) for t in range(nt)]
    r_of, t_of = [r for r, _ in inputs], [t for _, t in inputs]
    blocks = [b.gep(w_row, [b.mul(blk, ir.Constant(I64, fmt.block_bytes))]) for w_row in rows["w"]]
    headers = [fmt.header(b, p) for p in blocks]
    x_at = b.mul(blk, ir.Constant(I64, fmt.block_elems))
    dw = _by_input(b, [h["d"] for h in headers], r_of)
    dx = _by_input(b, [load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32) for xd in rows["xd"]], t_of)
    if fmt.act == ACT_Q8_K:
        bsums = [load(b, xa, b.mul(blk, ir.Constant(I64, 32)), V16I16) for xa in rows["xa"]]
    if "mins" in headers[0]:  # as pair sums: min times the activation sum of values 32j..32j+31
        mins = [_as_pairs(b, madd_pairs(b, headers[r]["mins"], bsums[t])) for r, t in inputs]
        dmin = _by_input(b, [h["dmin"] for h in headers], r_of)
    layout = _accumulators(fmt, path, len(inputs))
    new = dict(accs)

    def update(name, p: Packed, scale):
        """acc = fma(float(int), scale, acc) over the packed vectors (scale: by input)."""
        assert p.labels == layout[name][0], f"{name}: layout differs from the accumulator's"
        new[name] = [fmuladd(b, _to_float(b, v), _lanes(b, scale, p, k), acc)
                     for k, (v, acc) in enumerate(zip(p.vecs, new[name]))]

    def group_done(g, sums):
        """Float updates once the integer sums of group g (all values for VEC_DOT / TILED) are complete."""
        if path == VEC_DOT:
            lanes = _pack(b, sums, 8)
            if fmt.ggml_type == T_.Q6_K:  # minus 32 * (scale * bsum) of values 32j..32j+31
                corr = _pack(b, [_as_pairs(b, madd_pairs(b, headers[r]["scales"], bsums[t])) for r, t in inputs], 8)
                five = ir.Constant(vec(I32, LANES), [5] * LANES)
                lanes.vecs = [b.sub(v, b.shl(c, five)) for v, c in zip(lanes.vecs, corr.vecs)]
            if "mins" in headers[0]:
                neg_dmin = b.fmul(b.fneg(dx), dmin)
                if fmt.ggml_type == T_.Q2_K:  # mins first, into the same 8 lanes
                    update("lanes", _pack(b, mins, 8), neg_dmin)
                else:  # Q4_K: 4 lanes (sub-block pairs); Q5_K: a scalar chain
                    update("mins", _pack(b, mins, layout["mins"][1]), neg_dmin)
            update("lanes", lanes, b.fmul(dx, dw))
            if fmt.act == ACT_Q8_1:  # + m_w * s_x, a scalar fma chain per output
                m = _by_input(b, [h["m"] for h in headers], r_of)
                s = _by_input(b, [load(b, xa, b.mul(blk, ir.Constant(I64, 4)), F32) for xa in rows["xa"]], t_of)
                p = Packed(None, layout["sum"][0])
                new["sum"] = [fmuladd(b, _lanes(b, m, p, 0), _lanes(b, s, p, 0), new["sum"][0])]
        elif path == TILED:
            s1 = _pack(b, sums, 1)
            res = [b.fmul(_to_float(b, v), _lanes(b, dw, s1, k)) for k, v in enumerate(s1.vecs)]
            if "mins" in headers[0]:  # r = -(dmin * S2) + r, fused
                s2 = _pack(b, mins, 1)
                assert s2.labels == s1.labels
                res = [fmuladd(b, _lanes(b, b.fneg(dmin), s2, k), _to_float(b, v), r_)
                       for k, (v, r_) in enumerate(zip(s2.vecs, res))]
            new["acc"] = [fmuladd(b, r_, _lanes(b, dx, s1, k), acc) for k, (r_, acc) in enumerate(zip(res, new["acc"]))]
        else:  # GEMV / GEMM: acc += I * (d_w * d_x), accm += M * (dmin * d_x), per group of values
            acc = _pack(b, sums, 1)
            update("acc", acc, b.fmul(dw, dx))
            if "mins" in headers[0]:
                if n_groups == 1:
                    m = packed_mins
                else:  # one group of 16-value groups per pass
                    per = 16 // n_groups
                    m = Packed([_direct_mins(b, headers, bsums, nt, acc.owners(k), range(g * per, (g + 1) * per))
                                for k in range(len(acc.vecs))], acc.labels)
                update("accm", m, b.fmul(dmin, dx))

    n_groups = _groups(fmt, path)
    if path == GEMV and "mins" in headers[0]:
        packed_mins = _pack(b, mins, 1)
    group = fmt.block_elems // n_groups
    sums, g = [None] * len(inputs), 0
    unsigned = path == VEC_DOT  # Q6_K codes 0..63 with a bsums correction (ggml_vec_dot_q6_K_q8_K)
    for segs in zip(*(fmt.segments(b, p, h, unsigned) for p, h in zip(blocks, headers))):
        offset = segs[0][0]
        if offset // group != g:
            group_done(g, sums)
            sums, g = [None] * len(inputs), offset // group
        for t in range(nt):
            at = b.add(x_at, ir.Constant(I64, offset))
            if rows["x16"]:
                xv = load(b, rows["xq"][t], b.mul(at, ir.Constant(I64, 2)), V32I16)
            else:
                xv = b.sext(load(b, rows["xq"][t], at, V32I8), V32I16)
            for r in range(nr):
                prod = madd_pairs(b, segs[r][1], xv)
                i = r * nt + t
                sums[i] = prod if sums[i] is None else b.add(sums[i], prod)
    group_done(g, sums)
    return new


def _reduce(b, p: Packed, w: int) -> dict:
    """input -> float: the sum of its ``w`` partials in ggml's order (butterflies pairing partial
    j with j ^ 4, j ^ 2, j ^ 1: hsum_float_8 = ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)) for w = 8,
    (m0+m2)+(m1+m3) for w = 4)."""
    out = {}
    for v, labels in zip(p.vecs, p.labels):
        m = w // 2
        while m:
            i0 = labels[0][0]
            d = labels.index((i0, m)) ^ labels.index((i0, 0))
            assert all(labels[lane ^ d] == (i, part ^ m) for lane, (i, part) in enumerate(labels))
            v = b.fadd(v, shuffle(b, v, [lane ^ d for lane in range(LANES)]))
            labels = [(i, part & ~m) for i, part in labels]
            m //= 2
        for lane, (i, _) in enumerate(labels):
            if i not in out:
                out[i] = b.extract_element(v, ir.Constant(I32, lane))
    return out


def build_tile(module: ir.Module, fmt: BlockFormat, path: int, nr: int, nt: int, name: str,
               x16: bool = True) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)``.

    Pointers are i8* to the tile's first row (out: float*); strides in bytes (out: in floats);
    activation quants are int16 (``x16``) or int8. For r < nr, t < nt: out[t*out_stride + r*out_r_stride] =
    llama.cpp's ``path`` result for weight row r and activation row t over nb >= 1 blocks.
    """
    layout = _accumulators(fmt, path, nr * nt)
    zero = ir.Constant(V16F32, [0.0] * LANES)

    def body(b, rows, blk, accs):
        return _emit_block(b, fmt, path, dict(rows, x16=x16), blk, accs)

    def finish(b, new):
        res = {k: _reduce(b, Packed(new[k], labels), w) for k, (labels, w) in layout.items()}
        values = {}
        for i in range(nr * nt):
            if path in (GEMV, GEMM):
                value = b.fsub(res["acc"][i], res["accm"][i]) if "accm" in res else res["acc"][i]
            else:
                value = res["lanes" if path == VEC_DOT else "acc"][i]
                for extra in ("mins", "sum"):
                    if extra in res:
                        value = b.fadd(value, res[extra][i])
            values[divmod(i, nt)] = value
        return values

    return tile_function(module, name, nr, nt, {k: [zero] * len(labels) for k, (labels, _) in layout.items()},
                         body, finish, fmt.block_bytes)


@intrinsic
def qdot_tile(typingctx, fmt, path, nr, nt, w, r0, r_step, xq, xd, xa, t0, out):
    """out[t0 + t, r0 + r * r_step] = llama.cpp's dot(w[r0 + r * r_step], x[t0 + t]) for r < nr, t < nt.

    ``fmt`` (GGML type id of w), ``path`` (VEC_DOT, TILED, GEMV, GEMM), nr, nt are literals;
    r_step >= 0 (0: one row nr times); xq int8[T, K] or int16[T, K] quants, xd float32[T, K/block]
    scales, xa the Q8_1 sums float32[T, K/32] or the Q8_K bsums int16[T, K/16] (ignored for
    Q8_0), out float32[T, R] C-contiguous.
    """
    if not all(isinstance(a, types.IntegerLiteral) for a in (fmt, path, nr, nt)):
        return None
    if not isinstance(xq, types.Array) or xq.dtype not in (types.int8, types.int16):
        return None
    f = FORMATS[GGMLQuantizationType(fmt.literal_value)]
    p, n_r, n_t = path.literal_value, nr.literal_value, nt.literal_value
    sig = types.void(fmt, path, nr, nt, w, r0, r_step, xq, xd, xa, t0, out)

    def codegen(context, builder, signature, args):
        x16 = signature.args[7].dtype == types.int16
        name = f"edge_qdot_{f.ggml_type.name.lower()}_{PATH_NAMES[p]}_{n_r}x{n_t}{'_x16' if x16 else ''}"
        if builder.module.globals.get(name):
            fn = builder.module.globals.get(name)
        elif HAS_VNNI and p == VEC_DOT and f.ggml_type in (T_.Q5_0, T_.Q8_0, T_.Q6_K):
            fn = build_vnni_tile(builder.module, f.ggml_type.name, n_r, n_t, name, x16)
        elif n_r == ROWS and HAS_VNNI and (f.ggml_type in (T_.Q4_K, T_.Q6_K)
                                           or (p == GEMV and f.ggml_type in (T_.Q8_0, T_.Q5_0))):
            fn = build_rows_tile(builder.module, f.ggml_type.name, PATH_NAMES[p], n_t, name, x16)
        else:
            fn = build_tile(builder.module, f, p, n_r, n_t, name, x16)
        arrays = [context.make_array(ty)(context, builder, v) for ty, v in
                  zip(signature.args[4:], args[4:]) if isinstance(ty, types.Array)]
        aw, axq, axd, axa, aout = arrays
        r0v, r_stepv, t0v = (builder.sext(v, I64) if v.type != I64 else v for v in (args[5], args[6], args[10]))
        stride = lambda a: cgutils.unpack_tuple(builder, a.strides)[0]  # noqa: E731

        def base(a, i):
            ptr = builder.bitcast(a.data, BYTE_PTR)
            return builder.gep(ptr, [builder.mul(i, stride(a))])

        out_stride = builder.sdiv(stride(aout), ir.Constant(I64, 4))
        out_at = builder.gep(aout.data, [builder.add(builder.mul(t0v, out_stride), r0v)])
        nb = builder.sdiv(cgutils.unpack_tuple(builder, aw.shape)[1], ir.Constant(I64, f.block_bytes))
        builder.call(fn, [base(aw, r0v), builder.mul(stride(aw), r_stepv), base(axq, t0v), stride(axq),
                          base(axd, t0v), stride(axd), base(axa, t0v), stride(axa), out_at, out_stride, r_stepv, nb])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _rows(fmt, path, nd, w, xq, xd, xa, out):
    """qdot_tile in ND x 1 tiles only, for few activation rows (decode): a tile takes rows j,
    j + R // ND, ... (each thread streams ND far-apart row ranges; ND adjacent rows per tile
    stream from DRAM at half the speed) for every t. The R % ND last rows: one tile over the
    last ND rows (recomputing some: results do not depend on tiling), or, when R < ND, a tile
    repeating each row."""
    R, T = w.shape[0], xq.shape[0]
    part = R // nd
    for j in prange(part):
        for t in range(T):
            qdot_tile(fmt, path, nd, 1, w, j, part, xq, xd, xa, t, out)
    for t in range(T):
        if part == 0:
            for r in range(R):
                qdot_tile(fmt, path, nd, 1, w, r, 0, xq, xd, xa, t, out)
        elif R % nd:
            qdot_tile(fmt, path, nd, 1, w, R - nd, 1, xq, xd, xa, t, out)


@njit(cache=True, inline="always")
def _blocks(fmt, path, nr, tails, w, xq, xd, xa, out, wide=0):
    """qdot_tile in NR x NT tiles (T >= NT) over chunks of at most TC activation rows (equal
    chunks, a multiple of NT, so threads share evenly and a chunk stays in cache); the last
    NT-tile of a chunk overlaps its neighbour, or with ``tails`` (a literal) the rows left are
    done in ND x 1 tiles. The last row tile overlaps its neighbour (recomputed values are
    identical: results do not depend on tiling); with R < NR a tile repeats one row.
    ``wide`` (a literal, 0 or a multiple of NT): tiles of that many activation rows first, for
    tiles whose cost is mostly preparing the weights (kernels_cpu.matmul_rows GEMV tiles)."""
    R, T = w.shape[0], xq.shape[0]
    n_rt = (R + nr - 1) // nr
    n_tc = (T + TC - 1) // TC
    chunk = ((T + n_tc - 1) // n_tc + NT - 1) // NT * NT
    for job_ in prange(n_rt * n_tc):
        job = np.int64(job_)
        t_lo = (job // n_rt) * chunk
        t_hi = min(T, t_lo + chunk)
        for k in range(1 if R >= nr else R):
            r0 = min((job % n_rt) * nr, R - nr) if R >= nr else k
            step = 1 if R >= nr else 0
            t = t_lo
            if wide:
                while t + wide <= t_hi:
                    qdot_tile(fmt, path, nr, wide, w, r0, step, xq, xd, xa, t, out)
                    t += wide
            while t + NT <= t_hi:
                qdot_tile(fmt, path, nr, NT, w, r0, step, xq, xd, xa, t, out)
                t += NT
            if tails:
                while t < t_hi:
                    qdot_tile(fmt, path, nr, 1, w, r0, step, xq, xd, xa, t, out)
                    t += 1
            elif t < t_hi:
                qdot_tile(fmt, path, nr, NT, w, r0, step, xq, xd, xa, t_hi - NT, out)


@njit(cache=True, inline="always")
def _tiled(fmt, path, nr, w, xq, xd, xa, out, wide=0):
    """Run qdot_tile of ``path`` over all outputs: ND x 1 tiles (_rows) for T < NT, else
    NR x NT tiles (_blocks; ``wide``: see there)."""
    if xq.shape[0] < NT:
        _rows(fmt, path, nr, w, xq, xd, xa, out)
    else:
        _blocks(fmt, path, nr, True, w, xq, xd, xa, out, wide)


# ---------------------------------------------------------------------------------------------
# Per-type kernels. Shapes: w uint8[R, row_bytes], xqs int8[T, K] or int16[T, K] (the same
# quants widened, read with one load per segment), xd float32[T, K/block],
# xs float32[T, K/32], xbsums int16[T, K/16], out float32[T, R]; all C-contiguous.

_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = int(T_.Q4_0), int(T_.Q4_1), int(T_.Q5_0), int(T_.Q5_1), int(T_.Q8_0)
_Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K = int(T_.Q2_K), int(T_.Q3_K), int(T_.Q4_K), int(T_.Q5_K), int(T_.Q6_K)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_0_q8_0(w, xqs, xd, out):
    """Q4_0 weights x Q8_0 activations (ggml_vec_dot_q4_0_q8_0, tinyBLAS_Q0_AVX)."""
    _tiled(_Q4_0, VEC_DOT, NR, w, xqs, xd, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_0_q8_0_repacked(w, xqs, xd, out):
    """Q4_0 weights with R % 8 == 0, repacked by llama.cpp to q4_0_8x8: ggml_gemv and
    ggml_gemm_q4_0_8x8_q8_0 share the GEMV structure (one fma of the block's integer total
    per 32 values)."""
    _tiled(_Q4_0, GEMV, NR, w, xqs, xd, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q5_0_q8_0(w, xqs, xd, out):
    """Q5_0 weights x Q8_0 activations (ggml_vec_dot_q5_0_q8_0, tinyBLAS_Q0_AVX)."""
    _tiled(_Q5_0, VEC_DOT, NR_Q0, w, xqs, xd, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q8_0_q8_0(w, xqs, xd, out):
    """Q8_0 weights x Q8_0 activations (ggml_vec_dot_q8_0_q8_0, tinyBLAS_Q0_AVX)."""
    _tiled(_Q8_0, VEC_DOT, NR_Q0, w, xqs, xd, xd, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_1_q8_1(w, xqs, xd, xs, out):
    """Q4_1 weights x Q8_1 activations (ggml_vec_dot_q4_1_q8_1)."""
    _tiled(_Q4_1, VEC_DOT, NR, w, xqs, xd, xs, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q5_1_q8_1(w, xqs, xd, xs, out):
    """Q5_1 weights x Q8_1 activations (ggml_vec_dot_q5_1_q8_1)."""
    _tiled(_Q5_1, VEC_DOT, NR, w, xqs, xd, xs, out)


@njit(cache=True, inline="always")
def _plain_k(fmt, nr, nd, w, xqs, xd, xbsums, out):
    """K-quant weights in llama.cpp's plain CPU buffer: the tiled kernel for batches of >= 8
    rows (ggml_tiled_min_batch) in tiles of ``nr`` weight rows, else ggml_vec_dot_<type>_q8_K
    in tiles of ``nd`` rows."""
    if xqs.shape[0] >= 8:
        _blocks(fmt, TILED, nr, True, w, xqs, xd, xbsums, out)
    else:
        _tiled(fmt, VEC_DOT, nd, w, xqs, xd, xbsums, out)


@njit(cache=True, inline="always")
def _repacked_k(fmt, nr, w, xqs, xd, xbsums, out):
    """Q4_K / Q2_K weights with a multiple of 8 rows, which llama.cpp repacks (CPU_REPACK,
    ggml_repack_get_optimal_repack_type): the first T - T % 4 activation rows (when T > 3) by
    ggml_gemm_<type>_8x8_q8_K, the others by ggml_gemv_<type>_8x8_q8_K
    (tensor_traits::forward_mul_mat_one_chunk)."""
    T = xqs.shape[0]
    n4 = T - T % 4 if T > 3 else 0
    if n4 > 0:  # R % 8 == 0 and n4 % NT == 0: whole NR x NT tiles
        _blocks(fmt, GEMM, nr, False, w, xqs[:n4], xd[:n4], xbsums[:n4], out[:n4])
    if n4 < T:
        _rows(fmt, GEMV, nr, w, xqs[n4:], xd[n4:], xbsums[n4:], out[n4:])


@njit(parallel=True, cache=True, nogil=True)
def matmul_q2_k_q8_k(w, xqs, xd, xbsums, out):
    """Q2_K weights x Q8_K activations (see _plain_k)."""
    _plain_k(_Q2_K, NR, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q2_k_q8_k_repacked(w, xqs, xd, xbsums, out):
    """Q2_K weights with R % 8 == 0 (see _repacked_k)."""
    _repacked_k(_Q2_K, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q3_k_q8_k(w, xqs, xd, xbsums, out):
    """Q3_K weights x Q8_K activations (see _plain_k)."""
    _plain_k(_Q3_K, NR, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_k_q8_k(w, xqs, xd, xbsums, out):
    """Q4_K weights x Q8_K activations (see _plain_k)."""
    _plain_k(_Q4_K, NR, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_k_q8_k_repacked(w, xqs, xd, xbsums, out):
    """Q4_K weights with R % 8 == 0 (see _repacked_k)."""
    _repacked_k(_Q4_K, NR_ROWS, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q5_k_q8_k(w, xqs, xd, xbsums, out):
    """Q5_K weights x Q8_K activations (see _plain_k)."""
    _plain_k(_Q5_K, NR, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q6_k_q8_k(w, xqs, xd, xbsums, out):
    """Q6_K weights x Q8_K activations (see _plain_k)."""
    _plain_k(_Q6_K, NR_ROWS, ND_Q6_K, w, xqs, xd, xbsums, out)


# float weights: ggml_vec_dot_f32 / _f16 / _bf16 (float32 accumulation, any summation order)


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def matmul_f32_f32(w, x, out):
    """F32 weights w float32[R, K] x float32 x[T, K] -> out[T, R]."""
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            acc = np.float32(0.0)
            for k in range(x.shape[1]):
                acc += w[r, k] * x[t, k]
            out[t, r] = acc


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def matmul_f16_f16(w, x, out):
    """F16 weights w uint16[R, K] (binary16 bits) x x[T, K] already rounded to f16 (as float32)."""
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            acc = np.float32(0.0)
            for k in range(x.shape[1]):
                acc += f16_to_f32(w[r, k]) * x[t, k]
            out[t, r] = acc


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def matmul_bf16_bf16(w, x, out):
    """BF16 weights w uint16[R, K] (bf16 bits) x x[T, K] already rounded to bf16 (as float32)."""
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            acc = np.float32(0.0)
            for k in range(x.shape[1]):
                acc += f32_from_bits(np.uint32(w[r, k]) << np.uint32(16)) * x[t, k]
            out[t, r] = acc


@njit(cache=True, nogil=True)
def round_to_f16(x, out):
    """out = float32(f16(x)), round to nearest even (ggml_cpu_fp32_to_fp16). Shapes: f32[T, K]."""
    for t in range(x.shape[0]):
        for k in range(x.shape[1]):
            out[t, k] = f16_to_f32(f32_to_f16(x[t, k]))


@njit(cache=True, nogil=True)
def round_to_bf16(x, out):
    """out = float32(bf16(x)) as ggml_compute_fp32_to_bf16: nearest even, NaN made quiet. f32[T, K]."""
    bits_in = x.view(np.uint32)
    bits_out = out.view(np.uint32)
    for t in range(x.shape[0]):
        for k in range(x.shape[1]):
            u = bits_in[t, k]
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                h = (u >> np.uint32(16)) | np.uint32(64)
            else:
                h = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
            bits_out[t, k] = (h & np.uint32(0xFFFF)) << np.uint32(16)


# Batch-invariant kernels: every activation row gets the arithmetic llama.cpp gives a batch of
# one row (GEMV for repacked weights, VEC_DOT for the others), whatever T is, in multi-row
# tiles. A row's result then depends on that row alone, not on the batch it is computed in
# (the server's requirement: a request's text must not depend on what else is being served).
# Q5_0 / Q8_0 instead take the GEMV structure at every T and Q6_K llama.cpp's tiled kernel
# (faster in batches than their VEC_DOT, last bits not llama.cpp's for one row). Other types'
# llama.cpp paths are already one arithmetic for every T.


@njit(parallel=True, cache=True, nogil=True)
def matmul_q2_k_q8_k_bi(w, xqs, xd, xbsums, out):
    """Q2_K, batch-invariant (VEC_DOT for every T)."""
    _tiled(_Q2_K, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q2_k_q8_k_repacked_bi(w, xqs, xd, xbsums, out):
    """Q2_K repacked, batch-invariant (GEMV for every T)."""
    _tiled(_Q2_K, GEMV, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q3_k_q8_k_bi(w, xqs, xd, xbsums, out):
    """Q3_K, batch-invariant (VEC_DOT for every T)."""
    _tiled(_Q3_K, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_k_q8_k_bi(w, xqs, xd, xbsums, out):
    """Q4_K, batch-invariant (VEC_DOT for every T)."""
    _tiled(_Q4_K, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q4_k_q8_k_repacked_bi(w, xqs, xd, xbsums, out):
    """Q4_K repacked, batch-invariant (GEMV for every T)."""
    _tiled(_Q4_K, GEMV, NR_ROWS, w, xqs, xd, xbsums, out, NT_WIDE)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q5_k_q8_k_bi(w, xqs, xd, xbsums, out):
    """Q5_K, batch-invariant (VEC_DOT for every T)."""
    _tiled(_Q5_K, VEC_DOT, NR, w, xqs, xd, xbsums, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q6_k_q8_k_bi(w, xqs, xd, xbsums, out):
    """Q6_K, batch-invariant: the tiled kernel's arithmetic (llama.cpp's for T >= 8) for every T."""
    _tiled(_Q6_K, TILED, NR_ROWS, w, xqs, xd, xbsums, out, NT_WIDE)


_Q5_0_NEG_OFFSET, _Q8_0_NEG_OFFSET = -Q0_ROWS["Q5_0"][1], -Q0_ROWS["Q8_0"][1]  # matmul_rows' unsigned codes


@njit(cache=True, inline="always")
def _block_sums_32(xqs, factor):
    """int32[T, K/32]: ``factor`` times the sum of each 32-value block of the activation quants
    (int8 or int16); exact (|factor * sum| <= 128 * 32 * 128)."""
    out = np.empty((xqs.shape[0], xqs.shape[1] // 32), np.int32)
    for t in prange(xqs.shape[0]):
        for blk in range(out.shape[1]):
            total = 0
            for j in range(32 * blk, 32 * blk + 32):
                total += np.int32(xqs[t, j])
            out[t, blk] = total * factor
    return out


@njit(parallel=True, cache=True, nogil=True)
def matmul_q5_0_q8_0_bi(w, xqs, xd, out):
    """Q5_0, batch-invariant and faster than llama.cpp's VEC_DOT: GEMV structure (one float
    update of the exact block total per 32 values), VNNI tiles with one weight row per lane
    (kernels_cpu.matmul_rows, which take the activation quant sums of each block)."""
    _tiled(_Q5_0, GEMV, NR_ROWS, w, xqs, xd, _block_sums_32(xqs, _Q5_0_NEG_OFFSET), out, NT_WIDE)


@njit(parallel=True, cache=True, nogil=True)
def matmul_q8_0_q8_0_bi(w, xqs, xd, out):
    """Q8_0, batch-invariant (see matmul_q5_0_q8_0_bi)."""
    _tiled(_Q8_0, GEMV, NR_ROWS, w, xqs, xd, _block_sums_32(xqs, _Q8_0_NEG_OFFSET), out, NT_WIDE)


ROWS_TYPES = (T_.Q5_0, T_.Q8_0, T_.Q4_K, T_.Q6_K) if HAS_VNNI else ()  # VNNI kernels: int8 quants

QUANT_KERNELS = {  # llama.cpp's plain CPU buffer
    T_.Q4_0: matmul_q4_0_q8_0, T_.Q5_0: matmul_q5_0_q8_0, T_.Q8_0: matmul_q8_0_q8_0,
    T_.Q4_1: matmul_q4_1_q8_1, T_.Q5_1: matmul_q5_1_q8_1,
    T_.Q2_K: matmul_q2_k_q8_k, T_.Q3_K: matmul_q3_k_q8_k, T_.Q4_K: matmul_q4_k_q8_k,
    T_.Q5_K: matmul_q5_k_q8_k, T_.Q6_K: matmul_q6_k_q8_k,
}
REPACKED_KERNELS = {  # weights llama.cpp repacks on x86 (ggml_repack_get_optimal_repack_type), R % 8 == 0
    T_.Q4_0: matmul_q4_0_q8_0_repacked, T_.Q2_K: matmul_q2_k_q8_k_repacked, T_.Q4_K: matmul_q4_k_q8_k_repacked,
}


BATCH_INVARIANT_KERNELS = {
    T_.Q2_K: matmul_q2_k_q8_k_bi, T_.Q3_K: matmul_q3_k_q8_k_bi, T_.Q4_K: matmul_q4_k_q8_k_bi,
    T_.Q5_K: matmul_q5_k_q8_k_bi, T_.Q6_K: matmul_q6_k_q8_k_bi,
    T_.Q5_0: matmul_q5_0_q8_0_bi, T_.Q8_0: matmul_q8_0_q8_0_bi,
}
BATCH_INVARIANT_REPACKED = {T_.Q2_K: matmul_q2_k_q8_k_repacked_bi, T_.Q4_K: matmul_q4_k_q8_k_repacked_bi}


def quant_kernel(t: GGMLQuantizationType, n_rows: int, batch_invariant: bool = False):
    """The per-type kernel llama.cpp's choice calls for: REPACKED_KERNELS[t] when t is repacked
    and n_rows % 8 == 0, else QUANT_KERNELS[t] (separate functions, so that a process compiles
    only the paths its matrices take). ``batch_invariant``: the kernel whose arithmetic does not
    depend on the number of rows (BATCH_INVARIANT_*; see matmul), where llama.cpp's does or
    where a faster one exists (Q5_0 / Q8_0)."""
    repacked = n_rows % 8 == 0 and t in REPACKED_KERNELS
    if batch_invariant:
        kernel = (BATCH_INVARIANT_REPACKED if repacked else BATCH_INVARIANT_KERNELS).get(t)
        if kernel is not None:
            return kernel
    return REPACKED_KERNELS[t] if repacked else QUANT_KERNELS[t]


# ---------------------------------------------------------------------------------------------
# Python entry point


class MatmulWorkspace:
    """Preallocated activation buffers for matmul, so a decode loop allocates nothing.

    Holds room for up to ``max_tokens`` rows of up to ``max_k`` values in every activation format
    (quants as int8 and widened to int16, scales, Q8_1 sums, Q8_K bsums, f16/bf16-rounded x). One workspace
    serves one thread of calls: matmul overwrites it on every call.
    """

    def __init__(self, max_tokens: int, max_k: int):
        if max_tokens < 1 or max_k < 1:
            raise ValueError(f"workspace needs max_tokens >= 1 and max_k >= 1, got {max_tokens}, {max_k}")
        self.max_tokens, self.max_k = max_tokens, max_k
        n = max_tokens * max_k
        self._buffers = {"qs16": np.empty(n, np.int16), "qs8": np.empty(n, np.int8),
                         "d": np.empty(n // 32 + 1, np.float32), "s": np.empty(n // 32 + 1, np.float32),
                         "bsums": np.empty(n // 16 + 1, np.int16), "x": np.empty(n, np.float32)}
        self._views: dict[tuple[str, int, int], np.ndarray] = {}

    def take(self, name: str, shape: tuple[int, int], dtype=None) -> np.ndarray:
        """A C-contiguous view of buffer ``name`` ('qs16', 'qs8', 'd', 's', 'bsums', 'x') with ``shape``.

        ``dtype`` is accepted for symmetry with allocation and ignored (each buffer has its own).
        """
        key = (name, shape[0], shape[1])
        view = self._views.get(key)
        if view is None:
            T, K = shape
            buf = self._buffers[name]
            if T > self.max_tokens or K > self.max_k or T * K > buf.size:
                raise ValueError(f"workspace holds {self.max_tokens} x {self.max_k} values, asked for {T} x {K}")
            view = self._views[key] = buf[: T * K].reshape(T, K)
        return view


def _check_matmul(w, t: GGMLQuantizationType, x, out):
    if not isinstance(w, np.ndarray) or w.dtype != np.uint8 or w.ndim != 2 or not w.flags.c_contiguous:
        raise QuantFormatError(f"w must be C-contiguous uint8[R, row_bytes] rows, got "
                               f"{getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}")
    block_size, type_size = GGML_QUANT_SIZES[t]
    if w.shape[1] % type_size or w.shape[0] == 0 or w.shape[1] == 0:
        raise QuantFormatError(f"w rows of {w.shape[1]} bytes are not whole {t.name} blocks ({type_size} bytes)")
    k = w.shape[1] // type_size * block_size
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise QuantFormatError(f"x must be C-contiguous float32[T, K], got {getattr(x, 'dtype', type(x))} "
                               f"{getattr(x, 'shape', '')}")
    if x.shape[0] < 1 or x.shape[1] != k:
        raise QuantFormatError(f"x has shape {x.shape}, expected [T >= 1, {k}] for {t.name} rows of {k} values")
    shape = (x.shape[0], w.shape[0])
    if out is None:
        return np.empty(shape, np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise QuantFormatError(f"out must be a writeable C-contiguous float32{list(shape)}, got "
                               f"{getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}")
    return out


_TYPES: dict = {}  # the ggml_type argument as given (enum, int or name) -> GGMLQuantizationType


def _allocate(name: str, shape: tuple[int, int], dtype) -> np.ndarray:
    return np.empty(shape, dtype)


class QuantizedActivations:
    """Activations x f32[T, K] converted once to a weight type's vec_dot_type (Q8_0 / Q8_1 /
    Q8_K blocks), for several matmuls that read the same x (Q, K and V; gate and up).

    ``key`` names the format (activation format, int8 or int16 quants); ``arrays`` are the
    per-type kernel's activation arguments (quants, scales, and sums or bsums). Built by
    :func:`quantize_activations`; valid until the workspace it lives in is reused.
    """

    __slots__ = ("key", "shape", "arrays")

    def __init__(self, key: tuple, shape: tuple[int, int], arrays: tuple):
        self.key, self.shape, self.arrays = key, shape, arrays


def _act_key(t: GGMLQuantizationType) -> tuple:
    return FORMATS[t].act, t in ROWS_TYPES


def _quantize(t: GGMLQuantizationType, x: np.ndarray, buf) -> QuantizedActivations:
    # the quantize kernels are called directly: x and every buffer are valid by construction.
    # The quants are int8 for the VNNI row kernels, else widened to int16: one load per segment
    # instead of load + extend (5-9% faster decode), one compiled specialization per type.
    T, K = x.shape
    qs = buf("qs8", (T, K), np.int8) if t in ROWS_TYPES else buf("qs16", (T, K), np.int16)
    act = FORMATS[t].act
    if act == ACT_Q8_K:
        d, bsums = buf("d", (T, K // 256), np.float32), buf("bsums", (T, K // 16), np.int16)
        qa.quantize_q8_k_kernel(x, qs, d, bsums)
        arrays = (qs, d, bsums)
    elif act == ACT_Q8_1:
        d, s = buf("d", (T, K // 32), np.float32), buf("s", (T, K // 32), np.float32)
        qa.quantize_q8_1_kernel(x, qs, d, s)
        arrays = (qs, d, s)
    else:
        d = buf("d", (T, K // 32), np.float32)
        qa.quantize_q8_0_kernel(x, qs, d)
        arrays = (qs, d)
    return QuantizedActivations(_act_key(t), (T, K), arrays)


def quantize_activations(ggml_type, x: np.ndarray, workspace: MatmulWorkspace | None = None):
    """x f32[T, K] (C-contiguous) in the vec_dot_type of ``ggml_type`` weights, as llama.cpp
    converts src1 before a quantized matmul (quantize_row_q8_0 / q8_1 / q8_K): a
    :class:`QuantizedActivations` to pass to :func:`matmul` as ``xq`` for every weight of a type
    with the same activation format; None for F32/F16/BF16 weights (nothing to share).
    Raises QuantFormatError for a bad x or type, ValueError when the workspace is too small.
    """
    t = _TYPES.get(ggml_type)
    if t is None:
        t = _TYPES[ggml_type] = as_ggml_type(ggml_type)
    if t in (T_.F32, T_.F16, T_.BF16):
        return None
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise QuantFormatError(f"x must be C-contiguous float32[T, K], got {getattr(x, 'dtype', type(x))} "
                               f"{getattr(x, 'shape', '')}")
    if x.shape[1] % GGML_QUANT_SIZES[t][0]:
        raise QuantFormatError(f"x rows of {x.shape[1]} values are not whole {t.name} blocks")
    return _quantize(t, x, workspace.take if workspace is not None else _allocate)


def matmul(w: np.ndarray, ggml_type, x: np.ndarray, out: np.ndarray | None = None,
           workspace: MatmulWorkspace | None = None, xq: QuantizedActivations | None = None,
           batch_invariant: bool = False) -> np.ndarray:
    """out[t, r] = sum_k W[r, k] * x[t, k] with W stored as GGML ``ggml_type`` rows, as llama.cpp.

    Shapes: w uint8[R, row_bytes] (zero-copy GGUF rows, also for F32/F16/BF16), x float32[T, K]
    with T >= 1, out float32[T, R] (allocated when None). ``workspace`` supplies the quantized
    activation buffers (else they are allocated). ``xq``: x already quantized by
    :func:`quantize_activations` (used when its format is this type's, else x is quantized
    anew, outside the workspace so that xq stays valid). Raises QuantFormatError for an
    unsupported type or mismatched shapes/dtypes (K-quant rows need K % 256 == 0), ValueError
    when the workspace is too small. Python-side cost is a few microseconds per call.
    ``batch_invariant``: row t of out depends on x[t] alone, bit for bit, whatever T is: K-quants
    get llama.cpp's arithmetic for a batch of one (quant_kernel); Q5_0 / Q8_0 get the GEMV
    structure of llama.cpp's repacked q4_0 (one float update per block), faster than their
    VEC_DOT at every T but not bit-equal to llama.cpp's. Without it, llama.cpp switches K-quant
    kernels at T >= 4 (repacked) or T >= 8, which changes the last bits.
    """
    t = _TYPES.get(ggml_type)
    if t is None:
        t = _TYPES[ggml_type] = as_ggml_type(ggml_type)
    out = _check_matmul(w, t, x, out)
    T, K = x.shape
    buf = workspace.take if workspace is not None and xq is None else _allocate
    if t == T_.F32:
        matmul_f32_f32(w.view(np.float32), x, out)
    elif t in (T_.F16, T_.BF16):
        xr = buf("x", (T, K), np.float32)
        (round_to_f16 if t == T_.F16 else round_to_bf16)(x, xr)
        (matmul_f16_f16 if t == T_.F16 else matmul_bf16_bf16)(w.view(np.uint16), xr, out)
    else:
        if xq is None or xq.key != _act_key(t) or xq.shape != (T, K):
            xq = _quantize(t, x, buf)
        quant_kernel(t, w.shape[0], batch_invariant)(w, *xq.arrays, out)
    return out
