"""IQ4_NL / IQ4_XS / MXFP4 matmul tiles for CPUs with AVX2 and without AVX-512 VNNI: the codes
looked up with ``vpshufb`` and multiplied with ``vpmaddubsw``, one 32-value segment of one weight
row per 256-bit vector.

They reproduce the generic tiles (kernels_cpu.matmul_tiles) for these types and paths, bit for
bit: integer sums are exact in both, and the float operations are the same per output.

* VEC_DOT (IQ4_NL: tinyBLAS_Q0_AVX for T >= 2; IQ4_XS: ggml_vec_dot_iq4_xs_q8_K): 8 lanes per
  output, lane j the integer sum of values 4j..4j+3 of a 32-value block (IQ4_XS: of every
  sub-block of the 256, each times its scale ls - 32, ``vpmaddwd`` with the scale), then
  acc = fma(float(lane), d_w * d_x, acc) per block and hsum_float_8 at the end.
* GEMV (IQ4_NL / MXFP4 repacked to iq4_nl_8x8 / mxfp4_8x8: ggml_gemv and ggml_gemm_*_8x8_q8_0):
  one integer I per block and output, acc = fma(float(I), d_w * d_x, acc).
* TILED (IQ4_XS, T >= 8: ggml-cpu/tiled): one integer S per 256 values (the scaled sub-block
  sums), r = float(S) * d_w, acc = fma(r, d_x, acc).

The products are exact integers as in llama.cpp's AVX2 code (mul_add_epi8 in
ggml_vec_dot_iq4_nl_q8_0 / ggml_vec_dot_iq4_xs_q8_K), by a sign trick turned around: codes
c = table[nibble] (kvalues_iq4nl, -127..113, or kvalues_mxfp4, -12..12), ``vpmaddubsw(|x|,
c * sign(x))``, so |x| is taken once per activation segment for all weight rows and each row
costs one ``vpsignb`` (llama.cpp's |c|, x * sign(c) costs two). |c * sign(x)| <= 127 and |x| <=
127 (activation quants in [-127, 127], as quantize_row_q8_0 / _q8_K make them): pair sums at
most 2 * 127 * 127 = 32258, no int16 saturation. The tables hold no -128, which ``vpsignb``
could not negate.
With AVX-512 VNNI or AVX-VNNI (``{vex} vpdpbusd`` / ``vpdpwssd`` ymm, the same LLVM intrinsics;
ggml's tinyBLAS_Q0_AVX updot under __AVXVNNI__) IQ4_NL / MXFP4 lanes come from one ``vpdpbusd``
of the unsigned c + 128 by x, started at -128 * (sum of x's 4 values), and IQ4_XS adds its scaled
pair sums with ``vpdpwssd``: the same exact integers.
One output's partial integer sums are added across lanes with shuffles, exactly, 8 outputs per
vector, and the float updates of GEMV / TILED run on those 8-output vectors.

numba's on-disk cache keys the kernels on kernels_cpu/iq4_kernels.py only: after editing this
module, clear kernels_cpu/__pycache__/iq4_kernels.*.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as T
from llvmlite import ir

from kernels_cpu.ggml_types import TYPES
from kernels_cpu.iq4_decoders import KVALUES_IQ4NL, KVALUES_MXFP4, e8m0_half, lookup16
from kernels_cpu.matmul_avx2 import _quants
from kernels_cpu.matmul_tiles import GEMV, TILED, VEC_DOT
from kernels_cpu.simd import (F32, HAS_AVX_VNNI, HAS_VNNI, I8, I16, I32, I64, _x86_call, dot_i16, dot_u8_s8, fmuladd,
                              hsum_float_8, load, load_half, madd_u8_s8_256, shuffle, sign_i8_256, splat,
                              sum_pairs_i16_256, tile_function, vec)

V8I32, V8F32, V16I16, V32I8 = vec(I32, 8), vec(F32, 8), vec(I16, 16), vec(I8, 32)
_ZERO8 = ir.Constant(V8I32, [0] * 8)


def _lanes32(value: int):
    return ir.Constant(V8I32, [value] * 8)
# (type, path) pairs these tiles compute; every other pair keeps the generic tile
AVX2_IQ4_PATHS = frozenset({(T.IQ4_NL, VEC_DOT), (T.IQ4_NL, GEMV), (T.MXFP4, GEMV), (T.MXFP4, VEC_DOT),
                            (T.IQ4_XS, VEC_DOT), (T.IQ4_XS, TILED)})
_TABLES = {T.IQ4_NL: KVALUES_IQ4NL, T.MXFP4: KVALUES_MXFP4, T.IQ4_XS: KVALUES_IQ4NL}


def _scale_d(b, t, p):
    """float32 d of the block at i8* p: binary16 d, or MXFP4's e8m0 exponent halved."""
    if t == T.MXFP4:
        return e8m0_half(b, load(b, p, TYPES[t].offset("e"), I8))
    return load_half(b, p, TYPES[t].offset("d"))


def _xs_scales(b, p):
    """The 8 sub-block scales ls_j - 32 of the IQ4_XS block at p, each as <16 x i16> (block_iq4_xs:
    ls_j = (scales_l[j/2] >> 4(j%2)) & 0xF | ((scales_h >> 2j) & 3) << 4), formed in one vector."""
    row = TYPES[T.IQ4_XS]
    sh = splat(b, b.zext(load(b, p, row.offset("scales_h"), I16), I32), 8)
    sl = splat(b, load(b, p, row.offset("scales_l"), I32), 8)
    low = b.and_(b.lshr(sl, ir.Constant(V8I32, [8 * (j // 2) + 4 * (j % 2) for j in range(8)])), _lanes32(0xF))
    high = b.shl(b.and_(b.lshr(sh, ir.Constant(V8I32, [2 * j for j in range(8)])), _lanes32(3)), _lanes32(4))
    ls = b.bitcast(b.sub(b.or_(low, high), _lanes32(32)), V16I16)  # lane j's i16 at 2j
    return [shuffle(b, ls, [2 * j] * 16) for j in range(8)]


def _segment(b, t, p, j, shift: int = 0):
    """<32 x i8> codes c + shift (c = table[nibble]) of 32-value segment j of the block at p, low
    nibbles (values 0..15) first."""
    at = TYPES[t].offset("qs") + 16 * j
    both = shuffle(b, load(b, p, at, vec(I8, 16)), list(range(16)) * 2)  # vbroadcasti128
    high = b.lshr(b.bitcast(both, V8I32), ir.Constant(V8I32, [0] * 4 + [4] * 4))  # vpsrlvd: high lane >> 4
    idx = b.and_(b.bitcast(high, V32I8), ir.Constant(V32I8, [0x0F] * 32))
    return lookup16(b, [c + shift for c in _TABLES[t]], idx)


# merges of two <8 x i32> vectors a, c (indices >= 8 pick from c): result lane l = src[lo[l]] + src[hi[l]]
_MERGES = {
    "unpack": ([0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]),  # vpunpckldq + vpunpckhdq
    "lane": ([0, 2, 8, 10, 4, 6, 12, 14], [1, 3, 9, 11, 5, 7, 13, 15]),  # within 128-bit lanes (vshufps)
    "halves": ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]),  # lane k + lane k + 4 (vperm2i128)
}


KINDS = ("unpack", "lane", "halves")


def _merged(kind: str, a: list, c: list):
    """Labels after merging vectors labelled a, c (lane label: (output, original lanes it sums)),
    or None if a result lane would add two outputs or a lane twice."""
    lo, hi = _MERGES[kind] if kind in _MERGES else (list(range(8)), [lane ^ int(kind) for lane in range(8)])
    src = a + c
    out = []
    for x, y in zip(lo, hi):
        (i, p), (i2, p2) = src[x], src[y]
        if i != i2 or p & p2:
            return None
        out.append((i, p | p2))
    return out


def _plan(n: int):
    """How _totals adds the 8 partial-sum lanes of each of n <= 8 outputs: the merge steps
    (kind, pairs of vector indices; a "1"/"2"/"4" kind folds one vector with lane l ^ kind) and
    the (lane) of each output's total in the one vector left. Cheapest valid merge first."""
    labels = [[(i, 1 << lane) for lane in range(8)] for i in range(n)]
    steps = []
    while True:
        where = {}
        for lane, (i, p) in enumerate(labels[0]):
            if p == 0xFF:
                where.setdefault(i, lane)
        if len(labels) == 1 and len(where) == n:
            return steps, [where[i] for i in range(n)]
        if len(labels) == 1:
            for kind in ("4", "2", "1"):
                m = _merged(kind, labels[0], labels[0])
                if m:
                    steps.append((kind, [(0, 0)]))
                    labels = [m]
                    break
            continue
        if len(labels) % 2:
            labels = labels + [labels[-1]]
        pairs = [(k, k + 1) for k in range(0, len(labels), 2)]
        for kind in KINDS:
            merged = [_merged(kind, labels[a], labels[c]) for a, c in pairs]
            if all(merged):
                break
        assert all(merged), "no valid merge"
        steps.append((kind, pairs))
        labels = merged


def _lane_map(n: int) -> list:
    """Where _totals leaves each of n outputs: [(vector, lane)], output i = r * nt + t."""
    return [(i // 8, lane) for g in range(0, n, 8) for i, lane in zip(range(g, n), _plan(min(8, n - g))[1])]


def _totals(b, vecs: list) -> list:
    """<8 x i32> vectors of partial sums, one per output -> vectors of up to 8 outputs' totals,
    laid out as _lane_map says (exact: lanes of one output added, each once)."""
    out = []
    for g in range(0, len(vecs), 8):
        level = list(vecs[g:g + 8])
        for kind, pairs in _plan(len(level))[0]:
            if len(level) % 2 and len(level) > 1:
                level.append(level[-1])
            if kind in _MERGES:
                lo, hi = _MERGES[kind]
            else:
                lo, hi = list(range(8)), [lane ^ int(kind) for lane in range(8)]
            level = [b.add(shuffle(b, level[a], lo, level[c]), shuffle(b, level[a], hi, level[c])) for a, c in pairs]
        out.append(level[0])
    return out


def _by_output(b, scalars: list, n_out: int, g: int, ty=F32):
    """<8 x ty> whose lanes match _totals' vector g: the lane of output i holds scalars[i]
    (lanes holding no output: zero)."""
    v = ir.Constant(vec(ty, 8), [0] * 8)
    for i, (gi, lane) in enumerate(_lane_map(n_out)):
        if gi == g:
            v = b.insert_element(v, scalars[i], ir.Constant(I32, lane))
    return v


def _block(b, t, path, rows, blk, accs, x16: bool):
    """One weight block of every (weight row r, activation row t) pair, output i = r * nt + tt."""
    row = TYPES[t]
    nr, nt = len(rows["w"]), len(rows["xq"])
    n = nr * nt
    n_seg = row.block_size // 32
    ptrs = [b.gep(w, [b.mul(blk, ir.Constant(I64, row.type_size))]) for w in rows["w"]]
    dws = [_scale_d(b, t, p) for p in ptrs]
    dxs = [load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32) for xd in rows["xd"]]
    scales = [_xs_scales(b, p) for p in ptrs] if t == T.IQ4_XS else None
    x_at = b.mul(blk, ir.Constant(I64, row.block_size))
    lanes = [None] * n
    for j in range(n_seg):
        xs = [_quants(b, xq, b.add(x_at, ir.Constant(I64, 32 * j)), x16) for xq in rows["xq"]]
        if (HAS_VNNI or HAS_AVX_VNNI) and scales is None:  # (c + 128) * x by vpdpbusd, from -128 * (sum of 4 x)
            starts = [b.sub(_ZERO8, dot_u8_s8(b, _ZERO8, ir.Constant(V32I8, [-128] * 32), x)) for x in xs]
            for r, p in enumerate(ptrs):
                codes = _segment(b, t, p, j, 128)
                for tt in range(nt):
                    lanes[r * nt + tt] = dot_u8_s8(b, starts[tt], codes, xs[tt])
            continue
        abs_xs = [sign_i8_256(b, x, x) for x in xs]  # |x|, once for all weight rows
        for r, p in enumerate(ptrs):
            codes = _segment(b, t, p, j)
            for tt in range(nt):
                p16 = madd_u8_s8_256(b, abs_xs[tt], sign_i8_256(b, codes, xs[tt]))
                i = r * nt + tt
                if scales is not None and (HAS_VNNI or HAS_AVX_VNNI):  # vpdpwssd: scaled pair sums added in one step
                    lanes[i] = dot_i16(b, _ZERO8 if lanes[i] is None else lanes[i], p16, scales[r][j])
                    continue
                if scales is None:
                    part = sum_pairs_i16_256(b, p16)
                else:
                    part = _x86_madd(b, p16, scales[r][j])
                lanes[i] = part if lanes[i] is None else b.add(lanes[i], part)
    new = dict(accs)
    if path == VEC_DOT:
        new["acc"] = [fmuladd(b, b.sitofp(lanes[i], V8F32), splat(b, b.fmul(dxs[i % nt], dws[i // nt]), 8),
                              accs["acc"][i]) for i in range(n)]
        return new
    tot = _totals(b, lanes)
    res = []
    for g, v in enumerate(tot):
        fv = b.sitofp(v, V8F32)
        if t == T.MXFP4:  # the exponent bytes gathered, then converted as one vector
            exps = _by_output(b, [load(b, p, TYPES[t].offset("e"), I8) for p in ptrs for _ in range(nt)], n, g, I8)
            dw = e8m0_half(b, exps)
        else:  # the binary16 bits gathered, then one vcvtph2ps
            bits = _by_output(b, [load(b, p, TYPES[t].offset("d"), I16) for p in ptrs for _ in range(nt)], n, g, I16)
            dw = b.fpext(b.bitcast(bits, vec(ir.HalfType(), 8)), V8F32)
        dx = _by_output(b, [dxs[i % nt] for i in range(n)], n, g)
        if path == GEMV:  # acc = fma(I, d_w * d_x, acc)
            res.append(fmuladd(b, fv, b.fmul(dw, dx), accs["acc"][g]))
        else:  # TILED: acc = fma(I * d_w, d_x, acc)
            res.append(fmuladd(b, b.fmul(fv, dw), dx, accs["acc"][g]))
    new["acc"] = res
    return new


def _x86_madd(b, p16, s16):
    """<16 x i16> p16, s16 -> <8 x i32>: lane j = p16[2j] * s16[2j] + p16[2j+1] * s16[2j+1] (vpmaddwd ymm)."""
    return _x86_call(b, "llvm.x86.avx2.pmadd.wd", [p16, s16], V8I32)


def build_avx2_iq4_tile(module: ir.Module, t: T, path: int, nr: int, nt: int, name: str, x16: bool) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)`` as kernels_cpu.matmul_tiles.build_tile does for (``t``, ``path``) in
    AVX2_IQ4_PATHS, ``nr`` weight rows x ``nt`` activation rows; activation quants int8 (or
    int16 when ``x16``)."""
    assert (t, path) in AVX2_IQ4_PATHS, (t, path)
    n = nr * nt
    if path == VEC_DOT:
        zeros = [ir.Constant(V8F32, [0.0] * 8)] * n
    else:
        zeros = [ir.Constant(V8F32, [0.0] * 8)] * ((n + 7) // 8)

    def body(b, rows, blk, accs):
        return _block(b, t, path, rows, blk, accs, x16)

    def finish(b, new):
        out = {}
        if path == VEC_DOT:
            for i, v in enumerate(new["acc"]):
                out[divmod(i, nt)] = hsum_float_8(b, v)
            return out
        for i, (g, lane) in enumerate(_lane_map(n)):
            out[divmod(i, nt)] = b.extract_element(new["acc"][g], ir.Constant(I32, lane))
        return out

    return tile_function(module, name, nr, nt, {"acc": zeros}, body, finish, TYPES[t].type_size)
