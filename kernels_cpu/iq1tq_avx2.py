"""IQ1_S / IQ1_M / TQ1_0 / TQ2_0 matmul tiles for x86 CPUs with AVX2: per 32-value group of a
weight row its codes in one <32 x i8> vector (IQ1: four iq1s_grid rows gathered by scalar loads;
TQ1_0: base-3 trits by byte multiplies; TQ2_0: 2-bit fields by shifts), products with ``vpmaddubsw``
summed in int16 over the 8 groups of a block, then ``vpmaddwd`` into ggml's 8 int32 lanes, as the
__AVX2__ branches of ggml_vec_dot_iq1_s_q8_K, _iq1_m_, _tq1_0_ and _tq2_0_q8_K
(ggml-cpu/arch/x86/quants.c).

They reproduce kernels_cpu.iq1tq's numba kernels bit for bit (that module's docstring gives the
float order): integer sums are exact in both, the float operations are the same per output.

* VEC_DOT (T < 8, the batch-invariant kernels, TQ1_0 / TQ2_0 at every T): lane m of an output
  sums the values v with (v % 32) // 4 == m (IQ1: each 16 / 32 values times their scale 2s + 1;
  TQ: minus bsums[2m] + bsums[2m + 1]); per block acc = fma(float(lane), d_x * d_w, acc); the
  result hsum_float_8(acc). IQ1_S adds fma(0.125, acc1, .), acc1 a per-output fma chain over
  blocks of the integer sum of scale * delta sign * bsums (the 8 outputs of a vector in its
  lanes, kernels_cpu.iq4_avx2._totals); IQ1_M fma(0.125, hsum_float_8(acc2), .), acc2 8 lanes of
  scale * delta sign * y like acc's.
* TILED (IQ1 at T >= 8, llama.cpp's ggml-cpu/tiled): the block's integer
  S = 8 * (acc's integer lanes) + (the delta sums), acc = fma((f16(d) * 0.125) * float(S), d_x, acc),
  8 outputs per float vector.

int16 bounds: activation quants lie in [-127, 127] (quantize_row_q8_K). IQ1 pair sums of
scale (<= 15, unsigned) times grid-signed quants reach 2 * 15 * 127 = 3810, eight groups 30480;
TQ codes (<= 3) 762, eight groups 6096: below 32767, so the int16 sums are exact. The IQ1_S delta
term uses the bsums (the sums of the quants, as quantize_row_q8_K makes them; the numba tiled
kernel sums the quants themselves).

numba's on-disk cache keys the kernels on kernels_cpu/iq1tq_kernels.py only: after editing
this module clear kernels_cpu/__pycache__/iq1tq_kernels.*.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir

from kernels_cpu.ggml_types import TYPES
from kernels_cpu.iq1tq import IQ1S_GRID
from kernels_cpu.iq4_avx2 import _by_output, _lane_map, _totals, _x86_madd
from kernels_cpu.iq23_avx2 import Format, _c, _entry, _table
from kernels_cpu.matmul_avx2 import _quants
from kernels_cpu.matmul_tiles import TILED, VEC_DOT
from kernels_cpu.simd import (F32, I8, I16, I32, I64, fma, hsum_float_8, load, load_half, madd_u8_s8_256, shuffle,
                              sign_i8_256, splat, sum_pairs_i16_256, tile_function, vec)

V8I32, V8F32, V16I16, V32I16, V32I8, V4I64 = vec(I32, 8), vec(F32, 8), vec(I16, 16), vec(I16, 32), vec(I8, 32), vec(I64, 4)
AVX2_IQ1TQ_PATHS = frozenset({(T.IQ1_S, VEC_DOT), (T.IQ1_S, TILED), (T.IQ1_M, VEC_DOT), (T.IQ1_M, TILED),
                              (T.TQ1_0, VEC_DOT), (T.TQ2_0, VEC_DOT)})
FORMATS = {t: Format(t) for t in (T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0)}
DELTA = 0.125  # IQ1S_DELTA = IQ1M_DELTA


def _i16(values):
    return ir.Constant(V16I16, list(values))


def _signed(b, mag, neg):
    """mag where neg is 0, -mag where neg is -1 (integer vectors of one type)."""
    return b.sub(b.xor(mag, neg), neg)


def _grid_group(b, grid, p, at_qs: int, word, step: int):
    """<32 x i8> iq1s_grid rows of the 4 indices qs[k] | ((word >> step k) & 7) << 8, k < 4
    (qs the bytes at ``at_qs``, ``word`` an i32 holding the high bits)."""
    lo = b.zext(load(b, p, at_qs, vec(I8, 4)), vec(I32, 4))
    high = b.lshr(splat(b, word, 4), ir.Constant(vec(I32, 4), [step * k for k in range(4)]))
    idx = b.or_(lo, b.shl(b.and_(high, ir.Constant(vec(I32, 4), [7] * 4)), ir.Constant(vec(I32, 4), [8] * 4)))
    v = ir.Constant(V4I64, None)
    for k in range(4):
        v = b.insert_element(v, _entry(b, grid, b.extract_element(idx, _c(k))), _c(k))
    return b.bitcast(v, V32I8)


def _odd_scale(b, v, s: int):
    """2 * ((v >> s) & 7) + 1 of an i32 v."""
    two_v = b.shl(v, _c(1)) if s == 0 else b.lshr(v, _c(s - 1))
    return b.or_(b.and_(two_v, _c(14)), _c(1))


def _iq1m_d(b, p):
    """float32 scale of the IQ1_M block at p: the f16 whose nibbles are the top nibbles of scales[0..3]."""
    sc = [b.zext(load(b, p, 48 + 2 * k, I16), I32) for k in range(4)]
    bits = b.or_(b.or_(b.lshr(sc[0], _c(12)), b.and_(b.lshr(sc[1], _c(8)), _c(0xF0))),
                 b.or_(b.and_(b.lshr(sc[2], _c(4)), _c(0xF00)), b.and_(sc[3], _c(0xF000))))
    return b.fpext(b.bitcast(b.trunc(bits, I16), ir.HalfType()), F32)


def _iq1_group(b, t, p, ib: int, grid):
    """32-value group ib of the IQ1 block at p: (grid values <32 x i8>, scale bytes <32 x i8>
    (2s + 1 of each value), IQ1_M: <16 x i16> scale * delta sign of each vpmaddubsw pair, else None)."""
    if t == T.IQ1_S:  # d | qs[32] at 2 | u16 qh[8] at 34: index bits and, in bits 12..15, scale and sign
        qh = b.zext(load(b, p, 34 + 2 * ib, I16), I32)
        vals = _grid_group(b, grid, p, 2 + 4 * ib, qh, 3)
        return vals, splat(b, b.trunc(_odd_scale(b, qh, 12), I8), 32), None
    # qs[32] | qh[16] at 32 (a nibble per 8 values: 3 index bits, the delta sign) | u16 scales[4] at 48
    w = b.zext(load(b, p, 32 + 2 * ib, I16), I32)
    vals = _grid_group(b, grid, p, 4 * ib, w, 4)
    sc = b.zext(load(b, p, 48 + 2 * (ib // 2), I16), I32)
    ls = [b.trunc(_odd_scale(b, sc, 6 * (ib % 2) + 3 * h), I16) for h in range(2)]
    ls16 = shuffle(b, splat(b, ls[0], 16), list(range(8)) + list(range(24, 32)), splat(b, ls[1], 16))
    bytes_ = b.trunc(shuffle(b, ls16, [k // 2 for k in range(32)]), V32I8)
    bits = b.and_(b.lshr(splat(b, b.trunc(w, I16), 16), _i16(4 * (k // 4) + 3 for k in range(16))), _i16([1] * 16))
    return vals, bytes_, _signed(b, ls16, b.sub(_i16([0] * 16), bits))


_POW3 = [3 ** n for n in range(5)]


def _tq_group(b, t, p, g: int):
    """<32 x i8> codes (TQ1_0 trits 0..2, TQ2_0 0..3) of 32-value group g of the block at p
    (kernels_cpu.iq1tq._tq1_codes / _tq2_codes)."""
    if t == T.TQ2_0:  # value 128 j + 32 l + m: bits 2l of qs[32 j + m]
        q = load(b, p, 32 * (g // 4), V32I8)
        return b.and_(b.lshr(q, ir.Constant(V32I8, [2 * (g % 4)] * 32)), ir.Constant(V32I8, [3] * 32))
    if g < 5:  # qs[0:32] x 3**g
        q, pows = load(b, p, 0, V32I8), [_POW3[g]] * 32
    else:  # qs[32:48] x 3**(2(g-5)), 3**(2(g-5)+1); group 7: qs[32:48] x 81, qh[0:4] x 3**0..3
        q16 = load(b, p, 32, vec(I8, 16))
        if g < 7:
            q, pows = shuffle(b, q16, list(range(16)) * 2), [_POW3[2 * g - 10]] * 16 + [_POW3[2 * g - 9]] * 16
        else:
            qh = shuffle(b, load(b, p, 48, vec(I8, 4)), list(range(4)) * 4)
            q, pows = shuffle(b, q16, list(range(16)) + list(range(16, 32)), qh), [81] * 16 + [_POW3[k // 4] for k in range(16)]
    prod = b.and_(b.mul(b.zext(q, V32I16), ir.Constant(V32I16, pows)), ir.Constant(V32I16, [0xFF] * 32))
    return b.trunc(b.lshr(b.mul(prod, ir.Constant(V32I16, [3] * 32)), ir.Constant(V32I16, [8] * 32)), V32I8)


def _block(b, t, path, rows, blk, accs, x16: bool, grid):
    """One 256-value weight block of every (weight row r, activation row tt), output i = r * nt + tt."""
    bb = TYPES[t].type_size
    nr, nt = len(rows["w"]), len(rows["xq"])
    n = nr * nt
    iq1 = t in (T.IQ1_S, T.IQ1_M)
    ptrs = [b.gep(w, [b.mul(blk, ir.Constant(I64, bb))]) for w in rows["w"]]
    at_d = {T.IQ1_S: 0, T.TQ1_0: 52, T.TQ2_0: 64}
    dws = [_iq1m_d(b, p) if t == T.IQ1_M else load_half(b, p, at_d[t]) for p in ptrs]
    dxs = [load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32) for xd in rows["xd"]]
    bsums = [load(b, xa, b.mul(blk, ir.Constant(I64, 32)), V16I16) for xa in rows["xa"]]
    x_at = b.mul(blk, ir.Constant(I64, 256))
    p16, lanes2 = [None] * n, [None] * n
    for g in range(8):
        xs = [_quants(b, xq, b.add(x_at, ir.Constant(I64, 32 * g)), x16) for xq in rows["xq"]]
        if t == T.IQ1_M:  # y pair sums, for scale * delta sign * y
            ypairs = [madd_u8_s8_256(b, ir.Constant(V32I8, [1] * 32), x) for x in xs]
        for r, p in enumerate(ptrs):
            if iq1:
                vals, scale8, ss16 = _iq1_group(b, t, p, g, grid)
            else:
                codes = _tq_group(b, t, p, g)
            for tt in range(nt):
                i = r * nt + tt
                if iq1:
                    part = madd_u8_s8_256(b, scale8, sign_i8_256(b, xs[tt], vals))
                else:
                    part = madd_u8_s8_256(b, codes, xs[tt])
                p16[i] = part if p16[i] is None else b.add(p16[i], part)
                if t == T.IQ1_M:
                    part = _x86_madd(b, ypairs[tt], ss16)
                    lanes2[i] = part if lanes2[i] is None else b.add(lanes2[i], part)
    lanes = [sum_pairs_i16_256(b, v) for v in p16]
    if t == T.IQ1_S:  # per output <8 x i32> whose total is sum over ib of scale * sign * (bsums 2ib, 2ib+1)
        for r, p in enumerate(ptrs):
            qh = load(b, p, 34, vec(I16, 8))
            ls = b.or_(b.and_(b.lshr(qh, ir.Constant(vec(I16, 8), [11] * 8)), ir.Constant(vec(I16, 8), [14] * 8)),
                       ir.Constant(vec(I16, 8), [1] * 8))
            ss = _signed(b, ls, b.ashr(qh, ir.Constant(vec(I16, 8), [15] * 8)))
            ss16 = shuffle(b, ss, [k // 2 for k in range(16)])
            for tt in range(nt):
                lanes2[r * nt + tt] = _x86_madd(b, bsums[tt], ss16)
    new = dict(accs)
    if path == VEC_DOT:
        ds = [b.fmul(dxs[i % nt], dws[i // nt]) for i in range(n)]
        if not iq1:  # minus bsums[2m] + bsums[2m + 1]
            lanes = [b.sub(lanes[i], sum_pairs_i16_256(b, bsums[i % nt])) for i in range(n)]
        new["acc"] = [fma(b, splat(b, ds[i], 8), b.sitofp(lanes[i], V8F32), accs["acc"][i]) for i in range(n)]
        if t == T.IQ1_M:
            new["acc2"] = [fma(b, splat(b, ds[i], 8), b.sitofp(lanes2[i], V8F32), accs["acc2"][i]) for i in range(n)]
        elif t == T.IQ1_S:
            new["acc1"] = [fma(b, _by_output(b, ds, n, g), b.sitofp(v, V8F32), accs["acc1"][g])
                           for g, v in enumerate(_totals(b, lanes2))]
        return new
    three = ir.Constant(V8I32, [3] * 8)  # S = 8 * lanes + delta sums
    tots = _totals(b, [b.add(b.shl(lanes[i], three), lanes2[i]) for i in range(n)])
    dwf = [b.fmul(d, ir.Constant(F32, DELTA)) for d in dws]
    new["acc"] = [fma(b, b.fmul(_by_output(b, [dwf[i // nt] for i in range(n)], n, g), b.sitofp(v, V8F32)),
                      _by_output(b, [dxs[i % nt] for i in range(n)], n, g), accs["acc"][g])
                  for g, v in enumerate(tots)]
    return new


def build_avx2_iq1tq_tile(module: ir.Module, t: T, path: int, nr: int, nt: int, name: str, x16: bool) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)`` as kernels_cpu.matmul_tiles.build_tile's frame, for (``t``, ``path``) in
    AVX2_IQ1TQ_PATHS, ``nr`` weight rows x ``nt`` activation rows (Q8_K quants int8, or int16
    when ``x16``; ``xa`` the bsums int16[T, K/16])."""
    assert (t, path) in AVX2_IQ1TQ_PATHS, (t, path)
    n = nr * nt
    grid = _table(module, "edge_iq1s_grid", np.ascontiguousarray(IQ1S_GRID).view(np.uint64).ravel())
    zero = ir.Constant(V8F32, [0.0] * 8)
    accs = {"acc": [zero] * (n if path == VEC_DOT else (n + 7) // 8)}
    if path == VEC_DOT and t == T.IQ1_M:
        accs["acc2"] = [zero] * n
    elif path == VEC_DOT and t == T.IQ1_S:
        accs["acc1"] = [zero] * ((n + 7) // 8)
    delta = ir.Constant(F32, DELTA)

    def body(b, rows, blk, accs):
        return _block(b, t, path, rows, blk, accs, x16, grid)

    def finish(b, new):
        out = {}
        for i, (g, lane) in enumerate(_lane_map(n)):
            if path == TILED:
                out[divmod(i, nt)] = b.extract_element(new["acc"][g], _c(lane))
                continue
            s = hsum_float_8(b, new["acc"][i])
            if t == T.IQ1_M:
                s = fma(b, delta, hsum_float_8(b, new["acc2"][i]), s)
            elif t == T.IQ1_S:
                s = fma(b, delta, b.extract_element(new["acc1"][g], _c(lane)), s)
            out[divmod(i, nt)] = s
        return out

    return tile_function(module, name, nr, nt, accs, body, finish, TYPES[t].type_size)
