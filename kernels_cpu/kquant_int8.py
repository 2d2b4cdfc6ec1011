"""Q2_K / Q3_K / Q4_K / Q5_K / Q6_K matmul tiles with 8-bit products, for CPUs with AVX2 and
without AVX-512 VNNI (``vpmaddubsw`` + ``vpmaddwd``; ``vpdpbusd`` ymm in the 8-row tiles with
AVX-VNNI) and for arm64 with DotProd (``sdot``; with I8MM ``smmla`` in the 8-row Q4_K tiles):
simd.HAS_INT8_VEC_DOT. The weight codes stay bytes instead of being unpacked to int16 as in the
generic tile (kernels_cpu.matmul_tiles), whose results
they reproduce bit for bit: every integer sum is exact in both, and per output the same integer
sums become floats, meet the same float scales and are added in the same order (each path's float
structure: kernels_cpu.matmul).

Two kinds of tile. Shapes: w uint8 rows of 256-value blocks, activation quants int8[T, K] (or
int16, ``x16``), d_x float32[T, K/256], bsums int16[T, K/16], out float32.

* One weight row per vector (``build_kquant_tile``; every type on VEC_DOT and TILED, Q2_K and
  Q4_K also on GEMV / GEMM; any nr x nt): per 32-value segment of a block, the 32 codes of one
  row and 32 activation quants give an <8 x i32> vector whose lane j is the segment's scale
  times the sum of the products of values 4j..4j+3 (ggml's 8 lanes; the scale of values 0..15
  in lanes 0-3, of 16..31 in lanes 4-7): x86 ``vpmaddubsw`` (u8 codes x s8 quants, pair sums
  in int16) then ``vpmaddwd`` with the scales, arm64 two ``sdot`` (16 bytes each) times the
  scales. The integer step of llama.cpp's AVX2 ggml_vec_dot_q{2,3,4,5,6}_K_q8_K
  (arch/x86/quants.c). VEC_DOT keeps those lanes with the float structure of
  ggml_vec_dot_<type>_q8_K: acc = fma(float(lane), d_w * d_x, acc) per block and
  hsum_float_8 at the end; Q6_K's lanes minus 32 * scale * bsums of segment j in lane j,
  Q4_K's mins in 4 more lanes (scale -d_x * dmin, summed (m0 + m2) + (m1 + m3) and added),
  Q5_K's in a scalar fma chain, Q2_K's into the same 8 lanes first. TILED (ggml-cpu/tiled),
  GEMV / GEMM (ggml_gemv / ggml_gemm_q2_K_8x8_q8_K) add one output's lanes across vectors with
  shuffles (kernels_cpu.iq4_avx2._totals: 8 outputs per vector, exact) and run the float
  updates lane-wise on those vectors: TILED r = float(S1) * d_w, r = fma(-dmin, float(S2), r),
  acc = fma(r, d_x, acc); GEMV / GEMM acc = fma(float(I), d_w * d_x, acc), accm =
  fma(float(M), dmin * d_x, accm) per group of values, out = acc - accm.
* One weight row per lane (``build_kquant_rows_tile``: Q4_K GEMV / GEMM, the float structure
  of ggml_gemv / ggml_gemm_q4_K_8x8_q8_K; 8 weight rows x nt): kernels_cpu.matmul_rows'
  layout (16 bytes of each row's codes transposed in registers: vector c holds bytes 4c..4c+3
  of every row, 4 activation quants broadcast to all lanes) with ``vpmaddubsw`` + ``vpmaddwd``
  (the scale pairs), ``sdot`` or (AVX-VNNI) ``vpdpbusd`` ymm, and every float operation lane-wise,
  one output per lane. No sums across lanes: GEMM's four float updates per block would need
  four reductions in the other layout. Measured on Zen 4 running Haswell's code, one thread,
  weights in L2: GEMM 8 x 4 about 66 G multiply-adds/s against 44 for the one-row-per-vector
  4 x 4 tile (generic tile: 29), GEMV 8 x 1 41 against 30 (generic: 16). Q6_K TILED measured
  a little faster one row per vector (its codes take more registers to transpose than AVX2 has).
  With arm64 I8MM (simd.HAS_I8MM, path "neon-i8mm") each pair of activation rows of these tiles
  takes ``smmla`` instead (2 weight rows x 8 values x 2 activation rows per instruction, 32
  multiply-adds against sdot's 16; the rows' bytes not transposed but paired 8 at a time), and the
  pair's sums are taken apart into the one-row-per-lane vectors before the same float steps
  (_rows_q4_k); an odd last activation row and the one-row tiles (decode) keep sdot.

Exactness of ``vpmaddubsw``, which saturates its pair sums to int16: the codes are unsigned and
small, Q6_K 0..63 (its -32 through the bsums, as in ggml), Q5_K 0..31, Q4_K 0..15, Q2_K 0..3,
and |activation quant| <= 128 (quantize_row_q8_K gives -127..127): pair sums at most 2 * 63 *
128 = 16128. Q3_K's codes are signed (-4..3): |x| (u8) times the codes times sign(x)
(``vpsignb``), at most 2 * 128 * 4. The row tiles add the pair sums of 4 chunks (16 values) in
int16 before ``vpmaddwd``: at most 4 * 2 * 15 * 128 = 15360. ``sdot`` and
``smmla`` multiply signed by signed: every code is at most 127. ``vpdpbusd`` (AVX-VNNI) adds its u8 x s8 products in int32. The int32 lanes stay far from overflow (a block's lane at
most 8 segments * 128 * 4 * 63 * 128).

AVX-VNNI (simd.HAS_AVX_VNNI: Intel's Alder Lake and later, without AVX-512): the one-row-per-lane
tiles take the arm64 structure, a chain of ``vpdpbusd`` ymm over a scale's 4 chunks (u8 codes x s8
quants into int32, exact) and one ``vpmulld`` by the int32 scales (ggml's K-quant code has no such
step: its __AVXVNNI__ branches are the 4-way steps of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and, in
tinyBLAS, IQ4_NL). The one-row-per-vector tiles keep ``vpmaddubsw`` + ``vpmaddwd`` by the int16
scales (LLVM fuses that vpmaddwd and its add into ``{vex} vpdpwssd`` for such a CPU): their scales
change with every 32 values, one vpdpbusd, which a vpmulld would then follow every time. Measured
as a proxy (no AVX-VNNI CPU here: Zen 4 running both forms compiled for itself, vpdpbusd
EVEX-encoded; one thread, weights in L2; G multiply-adds/s, vpmaddubsw form -> vpdpbusd form): Q4_K
rows GEMV 8 x 1 47.0 -> 50.1, GEMM 8 x 4 78.5 -> 92.4; one row per vector with vpdpbusd + vpmulld,
Q4_K VEC_DOT 4 x 1 40.7 -> 35.6, Q6_K TILED 4 x 4 68.1 -> 60.4 (none faster: Q2_K .. Q6_K VEC_DOT 4
x 1 0-13% slower, Q4_K GEMM and Q3_K / Q6_K TILED 4 x 4 11%). llvm-mca's alderlake model (LLVM 14)
agrees, cycles per block: 8 x 1 175 -> 165, 8 x 4 439 -> 395, Q4_K VEC_DOT 4 x 1 131 -> 164, Q6_K
TILED 275 -> 330.

Register pressure: the loop body of a tile is one basic block, and LLVM's scheduler hoists its
loads to the top, which on AVX2's 16 vector registers turns into spills; the tiles put
``_reload`` barriers (loads stay after them) and ``_pin`` statements (a value is computed
before them) where the work should happen in order.

Chosen by kernels_cpu.matmul_tiling.qdot_tile (KQUANT_PATHS, KQUANT_ROWS_PATHS; Q4_K repacked
reaches the 8-row tiles through matmul_tiling.kq_rows); the K-quant kernels then take int8
activation quants (kernels_cpu.matmul_kernels.ROWS_TYPES). numba's on-disk cache keys matmul's
kernels on matmul_kernels.py only: after editing this module, clear
kernels_cpu/__pycache__/matmul_kernels.*.nbi / .nbc (and the same files under NUMBA_CACHE_DIR
where one is set).
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as T
from llvmlite import ir

from kernels_cpu.ggml_types import TYPES
from kernels_cpu.iq4_avx2 import _lane_map, _totals
from kernels_cpu.matmul_avx2 import _quants
from kernels_cpu.matmul_rows import _byte, _c, _halves_to_f32, _i16_pair, _load_rows, k_rows_tile
from kernels_cpu.matmul_tiles import GEMM, GEMV, TILED, VEC_DOT
from kernels_cpu.matmul_vnni import _reload
from kernels_cpu.simd import (F32, HAS_AVX_VNNI, HAS_DOTPROD, HAS_I8MM, I8, I16, I32, I64, _x86_call, concat, dot_u8_s8,
                              fmuladd, hsum_float_8, lanes_i8, load, load_half, madd_pairs, madd_u8_s8_256, sdot_256, shuffle,
                              sign_i8_256, smmla, splat, tile_function, vec)

V2I64, V4I32, V8I32, V4F32, V8F32 = vec(I64, 2), vec(I32, 4), vec(I32, 8), vec(F32, 4), vec(F32, 8)
V8I16, V16I16, V16I8, V32I8 = vec(I16, 8), vec(I16, 16), vec(I8, 16), vec(I8, 32)
_ZERO4, _ZERO8 = ir.Constant(V4I32, [0] * 4), ir.Constant(V8I32, [0] * 8)

KQUANT_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
_WITH_MINS = (T.Q2_K, T.Q4_K, T.Q5_K)
# (type, path) pairs of the one-row-per-vector tiles (every pair llama.cpp's choice can reach)
KQUANT_PATHS = frozenset({(t, p) for t in KQUANT_TYPES for p in (VEC_DOT, TILED)}
                         | {(t, p) for t in (T.Q2_K, T.Q4_K) for p in (GEMV, GEMM)})
# (type, path) pairs of the one-row-per-lane tiles (8 weight rows)
KQUANT_ROWS_PATHS = frozenset({(T.Q4_K, GEMV), (T.Q4_K, GEMM)})


# ---------------------------------------------------------------------------------------------
# integer steps (x86 AVX2 or arm64 DotProd)

def _opaque(b, v):
    """v through an empty asm statement (no side effects): LLVM cannot look through it, so the
    shuffles written on v are not merged with the ones that made it (x86 only)."""
    return b.asm(ir.FunctionType(v.type, [v.type]), "", "=x,0", [v], side_effect=False)


def _pin(b, v):
    """v, computed here: an empty asm statement with side effects and a memory clobber that takes v
    in a vector register and gives it back. LLVM keeps such statements in order and loads after
    them, so a tile's work stays in the order written (its scheduler otherwise hoists every load
    of a block to the top, and AVX2's 16 vector registers then spill them all)."""
    if HAS_DOTPROD and v.type == V4I32:
        return b.asm(ir.FunctionType(V4I32, [V4I32]), "", "=w,0,~{memory}", [v], side_effect=True)
    if HAS_DOTPROD:  # 128-bit NEON registers: each half of an <8 x i32>
        halves = [shuffle(b, v, range(4 * h, 4 * h + 4)) for h in range(2)]
        return concat(b, *(b.asm(ir.FunctionType(V4I32, [V4I32]), "", "=w,0,~{memory}", [x], side_effect=True)
                           for x in halves))
    return b.asm(ir.FunctionType(v.type, [v.type]), "", "=x,0,~{memory}", [v], side_effect=True)


def _pmaddwd(b, a, c):
    """<16 x i16> a, c -> <8 x i32>: lane j = a[2j] * c[2j] + a[2j+1] * c[2j+1] (exact; x86
    vpmaddwd ymm, on arm64 simd.madd_pairs' IR)."""
    if HAS_DOTPROD:
        return madd_pairs(b, a, c)
    return _x86_call(b, "llvm.x86.avx2.pmadd.wd", [a, c], V8I32)


def _dot4(b, acc, u, s):
    """<8 x i32> acc + (lane j: sum of u[4j+k] * s[4j+k], k < 4) for <32 x i8> u, s: arm64 two sdot
    (signed by signed, 16 bytes each: lanes 0-3, 4-7), x86 one vpdpbusd ymm (u unsigned, s signed:
    AVX-VNNI, or AVX-512 VNNI + VL)."""
    return sdot_256(b, acc, u, s) if HAS_DOTPROD else dot_u8_s8(b, acc, u, s)


def _seg_scale(b, h: dict, lo: int, hi: int):
    """The scale operand of _seg_dot for a segment whose values 0..15 have scale s[lo] and 16..31
    s[hi] (s = h["scales"], <16 x i8> signed): x86 <16 x i16> (i16 lanes 0-7 s[lo], 8-15 s[hi],
    for vpmaddwd), arm64 <8 x i32> (lanes 0-3 s[lo], 4-7 s[hi]). On x86 the scales are widened
    once per block to two vectors holding s[0..7] (then s[8..15]) in both 128-bit halves, and each
    segment's operand is one in-lane vpshufb of one of them (ggml: vpshufb + vpmovsxbw each)."""
    if HAS_DOTPROD:
        return b.sext(shuffle(b, h["scales"], [lo] * 4 + [hi] * 4), V8I32)
    if "halves" not in h:
        wide = b.sext(h["scales"], V16I16)
        h["halves"] = [_opaque(b, shuffle(b, wide, [8 * k + i for i in range(8)] * 2)) for k in range(2)]
    k = lo // 8
    assert hi // 8 == k
    return shuffle(b, h["halves"][k], [lo % 8] * 8 + [8 + hi % 8] * 8)


def _seg_dot(b, codes, x, scale, absx=None):
    """<8 x i32>: lane j = scale_j * (sum of codes[4j+k] * x[4j+k], k < 4), codes and x <32 x i8>
    (codes unsigned, or signed with ``absx`` = |x| given on x86), scale from _seg_scale."""
    if HAS_DOTPROD:
        return b.mul(_dot4(b, _ZERO8, codes, x), scale)
    if absx is not None:  # |x| * (codes * sign(x)): signed codes through vpmaddubsw
        p16 = madd_u8_s8_256(b, absx, sign_i8_256(b, codes, x))
    else:
        p16 = madd_u8_s8_256(b, codes, x)
    return _pmaddwd(b, p16, scale)


def _rows_scale(b, v):
    """The scale operand of _chunks_dot from <8 x i32> v (lane r: the scale of row r): AVX2 the
    i16 pair (v, v) per lane for vpmaddwd, arm64 and AVX-VNNI v."""
    if HAS_DOTPROD or HAS_AVX_VNNI:
        return v
    return b.bitcast(_i16_pair(b, v, v), V16I16)


def _chunks_dot(b, acc, codes: list, quads: list, scale, fold: int):
    """acc + scale * sum over c of (lane r: sum of the 4 products of codes[c] and quads[c]), <8 x i32>
    vectors as 4 bytes per lane (codes unsigned): on x86 ``fold`` chunks' vpmaddubsw pair sums are
    added in int16 (exact for the caller's codes, see the module docstring) before each vpmaddwd
    with the scale pairs; on arm64 a chain of sdot, with AVX-VNNI of vpdpbusd, then one multiply
    (vpmulld)."""
    if HAS_DOTPROD or HAS_AVX_VNNI:
        total = _ZERO8
        for c, q in zip(codes, quads):
            total = _dot4(b, total, b.bitcast(c, V32I8), b.bitcast(q, V32I8))
        return b.add(acc, b.mul(total, scale))
    p16 = None
    for i, (c, q) in enumerate(zip(codes, quads)):
        p = madd_u8_s8_256(b, b.bitcast(c, V32I8), b.bitcast(q, V32I8))
        p16 = p if p16 is None else b.add(p16, p)
        if (i + 1) % fold == 0 or i == len(codes) - 1:
            acc = b.add(acc, _pmaddwd(b, p16, scale))
            p16 = None
    return acc


# ---------------------------------------------------------------------------------------------
# one weight row per vector: block decoders (codes as bytes, scales as int16 vectors)

def _crumbs(b, v, shift: int):
    """(v >> shift) & 3 on <32 x i8>."""
    v = b.lshr(v, lanes_i8(b, shift, 32)) if shift else v
    return b.and_(v, lanes_i8(b, 3, 32))


class _Q2K:
    """block_q2_K: ``u8 scales[16] | u8 qs[64] | f16 d | f16 dmin``; value 128h + 32g + i is
    (qs[32h + i] >> 2g) & 3, 16-value group k has scale scales[k] & 15 and min scales[k] >> 4."""

    t, signed = T.Q2_K, False

    def header(self, b, p):
        row = TYPES[self.t]
        sc = load(b, p, row.offset("scales"), V16I8)
        return {"d": load_half(b, p, row.offset("d")), "dmin": load_half(b, p, row.offset("dmin")),
                "scales": b.and_(sc, lanes_i8(b, 0x0F, 16)), "scales16": b.zext(b.and_(sc, lanes_i8(b, 0x0F, 16)), V16I16),
                "mins": b.zext(b.lshr(sc, lanes_i8(b, 4, 16)), V16I16)}

    def segments(self, b, p, h):
        for half in range(2):
            v = load(b, p, TYPES[self.t].offset("qs") + 32 * half, V32I8)
            for g in range(4):
                k = 8 * half + 2 * g
                yield 128 * half + 32 * g, _crumbs(b, v, 2 * g), k, k + 1


class _Q3K:
    """block_q3_K: ``u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d``; value 128h + 32g + i is
    (qs[32h + i] >> 2g) & 3, minus 4 unless bit 4h + g of hmask[i]: signed codes -4..3, 6-bit
    scales minus 32 (kernels_cpu.matmul_decoders.Q3_K's header)."""

    t, signed = T.Q3_K, True

    def header(self, b, p):
        from kernels_cpu.matmul_decoders import Q3_K
        h = Q3_K().header(b, p)
        return {**h, "scales": b.trunc(h["scales"], V16I8)}  # -32..31

    def segments(self, b, p, h):
        for half in range(2):
            v = load(b, p, TYPES[self.t].offset("qs") + 32 * half, V32I8)
            for g in range(4):
                hbit = b.and_(b.lshr(h["hmask"], lanes_i8(b, 4 * half + g, 32)), lanes_i8(b, 1, 32))
                q = b.or_(_crumbs(b, v, 2 * g), b.shl(hbit, lanes_i8(b, 2, 32)))
                k = 8 * half + 2 * g
                yield 128 * half + 32 * g, b.sub(q, lanes_i8(b, 4, 32)), k, k + 1


class _Q4K:
    """block_q4_K: ``f16 d | f16 dmin | u8 scales[12] | u8 qs[128]``; sub-block j (32 values) is
    the low (j even) or high (j odd) nibbles of qs[32 * (j // 2):], with 6-bit scale and min
    (dequant.scale_min_k4). The header's ``scales``: <16 x i16>, lanes 0-7 the scales, 8-15 the mins."""

    t, signed = T.Q4_K, False

    def header(self, b, p):
        row = TYPES[self.t]
        at = row.offset("scales")
        u0, u1, u2 = (load(b, p, at + 4 * i, I32) for i in range(3))
        c = lambda v: ir.Constant(I32, v)  # noqa: E731
        low6, low4, top2 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
        words = [b.and_(u0, low6), b.or_(b.and_(u2, low4), b.shl(b.and_(b.lshr(u0, c(6)), top2), c(4))),
                 b.and_(u1, low6), b.or_(b.and_(b.lshr(u2, c(4)), low4), b.shl(b.and_(b.lshr(u1, c(6)), top2), c(4)))]
        v = ir.Constant(V4I32, ir.Undefined)
        for i, word in enumerate(words):
            v = b.insert_element(v, word, ir.Constant(I32, i))
        scales = b.bitcast(v, V16I8)  # 0..63
        h = {"d": load_half(b, p, row.offset("d")), "dmin": load_half(b, p, row.offset("dmin")),
             "scales": scales, "mins8": b.zext(shuffle(b, scales, range(8, 16)), V8I16)}
        if self.t == T.Q5_K:
            h["qh"] = load(b, p, row.offset("qh"), V32I8)
        return h

    def segments(self, b, p, h):
        for pair in range(4):
            v = load(b, p, TYPES[self.t].offset("qs") + 32 * pair, V32I8)
            for j in (2 * pair, 2 * pair + 1):
                q = b.and_(v, lanes_i8(b, 0x0F, 32)) if j % 2 == 0 else b.lshr(v, lanes_i8(b, 4, 32))
                if "qh" in h:  # Q5_K: bit 4 of value 32j + i is bit j of qh[i]
                    hb = b.lshr(h["qh"], lanes_i8(b, j, 32)) if j else h["qh"]
                    q = b.or_(q, b.shl(b.and_(hb, lanes_i8(b, 1, 32)), lanes_i8(b, 4, 32)))
                yield 32 * j, q, j, j


class _Q5K(_Q4K):
    """block_q5_K: ``f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]``: Q4_K plus bit 4 of
    value 32j + i = bit j of qh[i] (codes 0..31)."""

    t = T.Q5_K


class _Q6K:
    """block_q6_K: ``u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d``; value 128h + 32g + i has low
    bits from ql[64h + 32(g % 2) + i] (low nibble if g < 2), bits 4-5 (qh[32h + i] >> 2g) & 3; codes
    0..63 here (their -32 goes through the bsums, as in ggml_vec_dot_q6_K_q8_K)."""

    t, signed = T.Q6_K, False

    def header(self, b, p):
        row = TYPES[self.t]
        sc = load(b, p, row.offset("scales"), V16I8)
        return {"d": load_half(b, p, row.offset("d")), "scales": sc, "scales16": b.sext(sc, V16I16)}

    def segments(self, b, p, h):
        row = TYPES[self.t]
        for half in range(2):
            qh = load(b, p, row.offset("qh") + 32 * half, V32I8)
            ql = [load(b, p, row.offset("ql") + 64 * half + 32 * k, V32I8) for k in range(2)]
            for g in range(4):
                low = b.and_(ql[g % 2], lanes_i8(b, 0x0F, 32)) if g < 2 else b.lshr(ql[g % 2], lanes_i8(b, 4, 32))
                q = b.or_(low, b.shl(_crumbs(b, qh, 2 * g), lanes_i8(b, 4, 32)))
                k = 8 * half + 2 * g
                yield 128 * half + 32 * g, q, k, k + 1


_DECODERS = {T.Q2_K: _Q2K(), T.Q3_K: _Q3K(), T.Q4_K: _Q4K(), T.Q5_K: _Q5K(), T.Q6_K: _Q6K()}


def _sub_sums(b, bsums):
    """<16 x i16> bsums (16-value activation sums) -> <8 x i16> sums of the 32-value sub-blocks
    (exact: at most 32 * 127)."""
    return b.add(shuffle(b, bsums, range(0, 16, 2)), shuffle(b, bsums, range(1, 16, 2)))


def _mins8(b, t, h, bsums, subs):
    """<8 x i32>, 8 partials of one output's mins term M = sum over groups of min * activation sum:
    Q4_K / Q5_K lane j = min_j * S_j (sub-block j), Q2_K lane j = the two 16-value groups of
    segment j (madd of mins and bsums, as the generic tile's)."""
    if t == T.Q2_K:
        return _pmaddwd(b, h["mins"], bsums)
    return b.mul(b.zext(h["mins8"], V8I32), b.sext(subs, V8I32))


def _by_lane(b, values: list, index: list):
    """<8 x float>: lane l = values[index[l]] (scalars)."""
    small = ir.Constant(vec(F32, len(values)), ir.Undefined)
    for k, v in enumerate(values):
        small = b.insert_element(small, v, ir.Constant(I32, k))
    return shuffle(b, small, index)


def _vec_block(b, t, path, rows, blk, accs, x16):
    """One block of every (weight row r, activation row tt) pair of a one-row-per-vector tile:
    output i = r * nt + tt."""
    kq = _DECODERS[t]
    row = TYPES[t]
    nr, nt = len(rows["w"]), len(rows["xq"])
    n = nr * nt
    ptrs = [b.gep(w, [b.mul(blk, ir.Constant(I64, row.type_size))]) for w in rows["w"]]
    x_at = b.mul(blk, ir.Constant(I64, 256))
    dxs = [load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32) for xd in rows["xd"]]
    bsums = [load(b, xa, b.mul(blk, ir.Constant(I64, 32)), V16I16) for xa in rows["xa"]]
    subs = [_sub_sums(b, bs) for bs in bsums] if t in (T.Q4_K, T.Q5_K) else [None] * nt
    groups = {GEMM: 4 if t == T.Q4_K else 2}.get(path, 1)
    per_group = 8 // groups
    new = {k: list(v) for k, v in accs.items()}
    heads, gens = [None] * nr, [None] * nr

    def vec_dot_updates(r, ints):
        """Path VEC_DOT: the float updates of row r's outputs once its block is summed."""
        h = heads[r]
        for tt in range(nt):
            i = r * nt + tt
            lanes = ints[tt]
            if t == T.Q6_K:  # minus 32 * (scale * bsum) of each 32-value segment, in lane j for segment j
                lanes = b.sub(lanes, b.shl(_pmaddwd(b, h["scales16"], bsums[tt]), ir.Constant(V8I32, [5] * 8)))
            if t in _WITH_MINS:
                neg_dmin = b.fmul(b.fneg(dxs[tt]), h["dmin"])
                if t == T.Q2_K:  # mins first, into the same 8 lanes
                    new["acc"][i] = fmuladd(b, b.sitofp(_mins8(b, t, h, bsums[tt], None), V8F32), splat(b, neg_dmin, 8),
                                            new["acc"][i])
                else:
                    m4 = madd_pairs(b, h["mins8"], subs[tt])  # lane m: sub-blocks 2m, 2m + 1
                    if t == T.Q4_K:
                        new["accm"][i] = fmuladd(b, b.sitofp(m4, V4F32), splat(b, neg_dmin, 4), new["accm"][i])
                    else:  # Q5_K: one scalar chain
                        m = b.add(b.add(b.extract_element(m4, ir.Constant(I32, 0)), b.extract_element(m4, ir.Constant(I32, 1))),
                                  b.add(b.extract_element(m4, ir.Constant(I32, 2)), b.extract_element(m4, ir.Constant(I32, 3))))
                        new["accm"][i] = fmuladd(b, b.sitofp(m, F32), neg_dmin, new["accm"][i])
            new["acc"][i] = fmuladd(b, b.sitofp(lanes, V8F32), splat(b, b.fmul(dxs[tt], h["d"]), 8), new["acc"][i])

    where = _lane_map(n)

    def row_totals(g, r, ints, pending):
        """Paths TILED / GEMV / GEMM: row r's integer vectors of group g join ``pending``; each 8
        outputs (in order: _lane_map's layout) are added up (iq4_avx2._totals) and their float
        updates done as soon as they are complete, so few vectors stay live."""
        h = heads[r]
        for tt in range(nt):
            v = ints[tt]
            if t == T.Q6_K:
                v = b.sub(v, b.shl(_pmaddwd(b, h["scales16"], bsums[tt]), ir.Constant(V8I32, [5] * 8)))
            m = None
            if t in _WITH_MINS:
                m = _mins8(b, t, h, bsums[tt], subs[tt])
                if groups > 1:  # the group's lanes only (GEMM)
                    width = 8 // groups
                    m = shuffle(b, m, [lane if lane // width == g else 8 for lane in range(8)], _ZERO8)
            pending.append((r * nt + tt, v, m))
        while len(pending) >= 8 or (pending and r == nr - 1):
            chunk, pending[:] = pending[:8], pending[8:]
            k = chunk[0][0] // 8
            vi = _totals(b, [v for _, v, _ in chunk])[0]
            vm = _totals(b, [m for _, _, m in chunk])[0] if t in _WITH_MINS else None
            rows_in = sorted({i // nt for i, _, _ in chunk})
            r_idx, t_idx = [0] * 8, [0] * 8
            for i, _, _ in chunk:
                lane = where[i][1]
                r_idx[lane], t_idx[lane] = rows_in.index(i // nt), i % nt
            dw = _by_lane(b, [heads[q]["d"] for q in rows_in], r_idx)
            dx = _by_lane(b, dxs, t_idx)
            if path == TILED:  # r = S1 * d_w; r = fma(-dmin, S2, r); acc = fma(r, d_x, acc)
                res = b.fmul(b.sitofp(vi, V8F32), dw)
                if vm is not None:
                    dmin = _by_lane(b, [heads[q]["dmin"] for q in rows_in], r_idx)
                    res = fmuladd(b, b.fneg(dmin), b.sitofp(vm, V8F32), res)
                new["acc"][k] = fmuladd(b, res, dx, new["acc"][k])
            else:  # GEMV / GEMM: acc = fma(I, d_w * d_x, acc), accm = fma(M, dmin * d_x, accm)
                new["acc"][k] = fmuladd(b, b.sitofp(vi, V8F32), b.fmul(dw, dx), new["acc"][k])
                if vm is not None:
                    dmin = _by_lane(b, [heads[q]["dmin"] for q in rows_in], r_idx)
                    new["accm"][k] = fmuladd(b, b.sitofp(vm, V8F32), b.fmul(dmin, dx), new["accm"][k])

    for g in range(groups):
        pending = []
        for r in range(nr):
            if gens[r] is None:
                heads[r] = kq.header(b, ptrs[r])
                gens[r] = kq.segments(b, ptrs[r], heads[r])
            ints = [None] * nt
            for _ in range(per_group):
                _reload(b)  # a scheduling barrier: each segment's loads stay there (not hoisted, then spilled)
                offset, codes, lo, hi = next(gens[r])
                scale = _seg_scale(b, heads[r], lo, hi)
                for tt in range(nt):
                    x = _quants(b, rows["xq"][tt], b.add(x_at, ir.Constant(I64, offset)), x16)
                    absx = sign_i8_256(b, x, x) if kq.signed and not HAS_DOTPROD else None
                    v = _seg_dot(b, codes, x, scale, absx)
                    ints[tt] = v if ints[tt] is None else b.add(ints[tt], v)
            if path == VEC_DOT:
                vec_dot_updates(r, ints)
            else:
                row_totals(g, r, ints, pending)
    return new


def build_kquant_tile(module: ir.Module, t: T, path: int, nr: int, nt: int, name: str, x16: bool) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)`` as kernels_cpu.matmul_tiles.build_tile does for (``t``, ``path``) in
    KQUANT_PATHS, one weight row per vector: ``nr`` weight rows x ``nt`` activation rows of
    256-value blocks, activation quants int8 (or int16 when ``x16``), xa the Q8_K bsums
    int16[T, K/16]. Float structure: ggml_vec_dot_<type>_q8_K (VEC_DOT), ggml-cpu/tiled (TILED),
    ggml_gemv / ggml_gemm_<type>_8x8_q8_K (GEMV / GEMM)."""
    assert (t, path) in KQUANT_PATHS, (t, path)
    n = nr * nt
    if path == VEC_DOT:
        accs = {"acc": [ir.Constant(V8F32, [0.0] * 8)] * n}
        if t == T.Q4_K:
            accs["accm"] = [ir.Constant(V4F32, [0.0] * 4)] * n
        elif t == T.Q5_K:
            accs["accm"] = [ir.Constant(F32, 0.0)] * n
    else:
        accs = {"acc": [ir.Constant(V8F32, [0.0] * 8)] * ((n + 7) // 8)}
        if path in (GEMV, GEMM):
            accs["accm"] = list(accs["acc"])

    def body(b, rows, blk, accs_):
        return _vec_block(b, t, path, rows, blk, accs_, x16)

    def finish(b, new):
        out = {}
        if path == VEC_DOT:
            for i, v in enumerate(new["acc"]):
                value = hsum_float_8(b, v)
                if t == T.Q4_K:  # (m0 + m2) + (m1 + m3)
                    m = new["accm"][i]
                    m = b.fadd(m, shuffle(b, m, [2, 3, 0, 1]))
                    m = b.fadd(m, shuffle(b, m, [1, 0, 3, 2]))
                    value = b.fadd(value, b.extract_element(m, ir.Constant(I32, 0)))
                elif t == T.Q5_K:
                    value = b.fadd(value, new["accm"][i])
                out[divmod(i, nt)] = value
            return out
        for i, (g, lane) in enumerate(_lane_map(n)):
            value = b.extract_element(new["acc"][g], ir.Constant(I32, lane))
            if "accm" in new:
                value = b.fsub(value, b.extract_element(new["accm"][g], ir.Constant(I32, lane)))
            out[divmod(i, nt)] = value
        return out

    return tile_function(module, name, nr, nt, accs, body, finish, TYPES[t].type_size)


# ---------------------------------------------------------------------------------------------
# one weight row per lane (8 rows): Q4_K GEMV / GEMM

def _row_pair(b, w_rows, q: int, offset: int) -> list:
    """32 bytes at ``offset`` of the blocks of rows 2q and 2q + 1 as smmla's weight operands: 4
    <16 x i8>, vector c bytes 8c..8c+7 of row 2q, then the same of row 2q + 1 (arm64 zip1 / zip2
    on 64-bit lanes)."""
    halves = [[load(b, w_rows[2 * q + i], offset + 16 * h, V2I64) for i in range(2)] for h in range(2)]
    return [b.bitcast(shuffle(b, r0, [k, 2 + k], r1), V16I8) for r0, r1 in halves for k in range(2)]


def _act_octets(b, a0, a1, offset: int):
    """<16 x i8>: activation quants offset..offset+7 of the block of row a0, then of row a1 (_Act;
    int16 quants narrowed): smmla's operand of two activation columns."""
    words = []
    for a in (a0, a1):
        at = b.add(a.x_at, ir.Constant(I64, offset))
        if a.x16:
            words.append(b.bitcast(b.trunc(load(b, a.xq, b.mul(at, ir.Constant(I64, 2)), vec(I16, 8)), vec(I8, 8)), I64))
        else:
            words.append(load(b, a.xq, at, I64))
    v = ir.Constant(V2I64, ir.Undefined)
    for k, w in enumerate(words):
        v = b.insert_element(v, w, ir.Constant(I32, k))
    return b.bitcast(v, V16I8)


def _rows_q4_k(b, w_rows, acts, kind, accs):
    """One Q4_K block of 8 rows: GEMV (one float update) or GEMM (one per 64 values), the integers
    and float steps of kernels_cpu.matmul_rows._q4_k_block. The codes are transposed 16 bytes of
    each row at a time (4 chunk vectors) and every value is computed where it is used: AVX2 has 16
    vector registers, and the chunks of 32 bytes (8 vectors) kept live too many.

    With I8MM (simd.HAS_I8MM) activation rows 2i, 2i + 1 go through smmla instead (an odd last row
    through sdot): per 8 values, row pair q's codes (_row_pair) times the two rows' quants
    (_act_octets) give <4 x i32> [(2q, 2i), (2q, 2i + 1), (2q + 1, 2i), (2q + 1, 2i + 1)]; each
    sub-block's chain of 4 smmla is multiplied by the row pair's scales in that layout and summed,
    and the sums are taken apart (uzp1 / uzp2) into the one-row-per-lane <8 x i32> of each
    activation row before the float steps, which are the same. The same exact integer sums reach
    the same float operations: bit-equal to the sdot and generic tiles."""
    h0, u0, u1, u2 = _load_rows(b, w_rows, 0, 4)
    acc, accm = list(accs["acc"]), list(accs["accm"])
    pairs = [(t, t + 1) for t in range(0, len(acts) - 1, 2)] if HAS_I8MM else []
    singles = [t for t in range(len(acts)) if not any(t in pr for pr in pairs)]

    def scale(j):
        word = b.and_(u0, _c(0x3F3F3F3F)) if j < 4 else \
            b.or_(b.and_(u2, _c(0x0F0F0F0F)), b.shl(b.and_(b.lshr(u0, _c(6)), _c(0x03030303)), _c(4)))
        return _rows_scale(b, _byte(b, word, j % 4))

    def min_terms(p):
        """<8 x i32> per activation row: min_{2p} * S_{2p} + min_{2p+1} * S_{2p+1} (lanes = rows)."""
        word = b.and_(u1, _c(0x3F3F3F3F)) if p < 2 else \
            b.or_(b.and_(b.lshr(u2, _c(4)), _c(0x0F0F0F0F)), b.shl(b.and_(b.lshr(u1, _c(6)), _c(0x03030303)), _c(4)))
        pair = b.bitcast(_i16_pair(b, _byte(b, word, 2 * (p % 2)), _byte(b, word, 2 * (p % 2) + 1)), V16I16)
        return [_pmaddwd(b, pair, b.bitcast(a.bsum_pair(4 * p, 2), V16I16)) for a in acts]

    tot = [_ZERO8] * len(acts)
    tot_mm = [[_ZERO4] * 4 for _ in pairs]  # per pair of activation rows and row pair q: smmla's layout
    for p in range(4):  # sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles) of qs[32p:32p+32]
        for half in range(2) if singles else ():
            _reload(b)  # these 16 bytes of the 8 rows are loaded (and transposed) here, not hoisted
            raw = _load_rows(b, w_rows, 16 + 32 * p + 16 * half, 4)
            for j, at in ((0, 64 * p + 16 * half), (1, 64 * p + 32 + 16 * half)):
                if j == 0:
                    codes = [b.and_(v, _c(0x0F0F0F0F)) for v in raw]
                else:
                    codes = [b.and_(b.lshr(v, _c(4)), _c(0x0F0F0F0F)) for v in raw]
                sc = scale(2 * p + j)
                for t in singles:  # each activation row's quads loaded where used, not all hoisted
                    a = acts[t]
                    tot[t] = _pin(b, _chunks_dot(b, tot[t], codes, [a.quad(at + 4 * c) for c in range(4)], sc, 4))
        for j in range(2) if pairs else ():  # sub-block 2p + j: one chain of 4 smmla per row pair and pair of rows
            _reload(b)
            sc = scale(2 * p + j)
            xs = [[_act_octets(b, acts[t0], acts[t1], 64 * p + 32 * j + 8 * c) for c in range(4)] for t0, t1 in pairs]
            for q in range(4):
                _reload(b)  # the row pair's bytes loaded here (again for each sub-block: 8 vectors fewer live)
                codes = [b.and_(v, lanes_i8(b, 0x0F, 16)) if j == 0 else b.lshr(v, lanes_i8(b, 4, 16))
                         for v in _row_pair(b, w_rows, q, 16 + 32 * p)]
                sc_q = shuffle(b, sc, [2 * q, 2 * q, 2 * q + 1, 2 * q + 1])
                for i in range(len(pairs)):
                    m = _ZERO4
                    for c in range(4):
                        m = smmla(b, m, codes[c], xs[i][c])
                    tot_mm[i][q] = _pin(b, b.add(tot_mm[i][q], b.mul(m, sc_q)))
        if kind == "gemm" or p == 3:
            for i, (t0, t1) in enumerate(pairs):  # lanes (2q, t0), (2q, t1), (2q + 1, t0), (2q + 1, t1) -> rows
                v = tot_mm[i]
                tot[t0] = concat(b, shuffle(b, v[0], [0, 2, 4, 6], v[1]), shuffle(b, v[2], [0, 2, 4, 6], v[3]))
                tot[t1] = concat(b, shuffle(b, v[0], [1, 3, 5, 7], v[1]), shuffle(b, v[2], [1, 3, 5, 7], v[3]))
                tot_mm[i] = [_ZERO4] * 4
            ms = None
            for q in ([p] if kind == "gemm" else range(4)):
                terms = min_terms(q)
                ms = terms if ms is None else [b.add(m, x) for m, x in zip(ms, terms)]
            d, dmin = _halves_to_f32(b, h0, 0), _halves_to_f32(b, h0, 16)
            for t, a in enumerate(acts):
                acc[t] = fmuladd(b, b.sitofp(tot[t], V8F32), b.fmul(d, a.d), acc[t])
                accm[t] = fmuladd(b, b.sitofp(ms[t], V8F32), b.fmul(dmin, a.d), accm[t])
            tot = [_ZERO8] * len(acts)
    return {"acc": acc, "accm": accm}


def build_kquant_rows_tile(module: ir.Module, t: T, path: int, nt: int, name: str, x16: bool) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)`` as kernels_cpu.matmul_tiles.build_tile does, for 8 weight rows (one per
    vector lane) x ``nt`` activation rows of (``t``, ``path``) in KQUANT_ROWS_PATHS: Q4_K GEMV /
    GEMM (float structure of ggml_gemv / ggml_gemm_q4_K_8x8_q8_K); activation quants int8 (or
    int16 when ``x16``), xa the Q8_K bsums int16[T, K/16]."""
    assert (t, path) in KQUANT_ROWS_PATHS, (t, path)
    return k_rows_tile(module, name, nt, TYPES[t].type_size, _rows_q4_k, "gemv" if path == GEMV else "gemm", x16,
                       with_min=True)
