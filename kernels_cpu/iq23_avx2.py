"""IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S matmul tiles for CPUs with AVX2 and without
AVX-512 VNNI: per 32-value group of a weight row, its grid entries gathered (scalar loads of a
table entry inserted into a vector), the signs applied to the activation quants (byte masks),
products with ``vpmaddubsw`` and the scales with ``vpmaddwd``, as the __AVX2__ branches of
ggml_vec_dot_iq2_xxs_q8_K, _iq2_xs_, _iq2_s_, _iq3_xxs_ and _iq3_s_q8_K (ggml-cpu/arch/x86/quants.c).

They reproduce kernels_cpu.iq23's numba kernels bit for bit (that module's docstring gives the
arithmetic): integer sums are exact in both, the float operations are the same per output.

* VEC_DOT (T < 8, and the batch-invariant kernels): 8 int32 lanes per output, lane l the sum of
  values 4l..4l+3 of every 32, each 32 / 16 values times their integer scale 2 * s + 1; per
  block acc = fma(float(lane), d_w * d_x, acc); at the end hsum_float_8 times the type's
  factor (1/8 IQ2_*, 1/4 IQ3_XXS, 1 IQ3_S).
* TILED (T >= 8: ggml-cpu/tiled): one integer S per block, acc = fma((d_w * factor) * float(S),
  d_x, acc), 8 outputs per float vector (kernels_cpu.iq4_avx2._totals).

Saturation: grid values are unsigned and at most 62 (IQ3_XXS), activation quants in
[-127, 127] (quantize_row_q8_K), so ``vpmaddubsw`` pair sums stay below 2 * 62 * 127 = 15748.

Grids and ksigns come from gguf.quants (kernels_cpu.iq23's arrays), embedded as LLVM constant
arrays (one per module that uses them). numba's on-disk cache keys the kernels on
kernels_cpu/iq23_kernels.py only: after editing this module clear kernels_cpu/__pycache__/iq23_kernels.*.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir

from kernels_cpu.ggml_types import TYPES
from kernels_cpu.iq4_avx2 import _by_output, _lane_map, _totals, _x86_madd
from kernels_cpu.iq23 import IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS
from kernels_cpu.matmul_avx2 import _quants
from kernels_cpu.matmul_tiles import TILED, VEC_DOT
from kernels_cpu.simd import (F32, I8, I16, I32, I64, _x86_call, fmuladd, hsum_float_8, load, load_half, madd_u8_s8_256, shuffle,
                              splat, tile_function, vec)

V8I32, V8F32, V16I16, V32I8, V4I64 = vec(I32, 8), vec(F32, 8), vec(I16, 16), vec(I8, 32), vec(I64, 4)
IQ23_TYPES = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)
AVX2_IQ23_PATHS = frozenset((t, p) for t in IQ23_TYPES for p in (VEC_DOT, TILED))
FACTOR = {T.IQ2_XXS: 0.125, T.IQ2_XS: 0.125, T.IQ2_S: 0.125, T.IQ3_XXS: 0.25, T.IQ3_S: 1.0}
# grid rows packed little-endian: 8-value grids as u64, 4-value grids as u32
_GRIDS = {T.IQ2_XXS: IQ2XXS_GRID, T.IQ2_XS: IQ2XS_GRID, T.IQ2_S: IQ2S_GRID, T.IQ3_XXS: IQ3XXS_GRID, T.IQ3_S: IQ3S_GRID}


class Format:
    """What kernels_cpu.matmul_tiling.qdot_tile needs of one of these types (the tiles are built here)."""

    def __init__(self, t: T):
        self.ggml_type, self.block_bytes = t, TYPES[t].type_size


FORMATS = {t: Format(t) for t in IQ23_TYPES}


def _table(module: ir.Module, name: str, values: np.ndarray):
    """i8* to an internal constant global holding ``values`` (1-D, u8 / u32 / u64), defined once per module."""
    g = module.globals.get(name)
    if g is None:
        ty = ir.IntType(8 * values.dtype.itemsize)
        arr = ir.ArrayType(ty, values.size)
        g = ir.GlobalVariable(module, arr, name)
        g.initializer = ir.Constant(arr, [int(v) for v in values])
        g.global_constant = True
        g.linkage = "internal"
        g.align = 64
    return g


def _grid_table(module, t):
    grid = _GRIDS[t]
    packed = np.ascontiguousarray(grid).view(np.uint64 if grid.shape[1] == 8 else np.uint32).ravel()
    return _table(module, f"edge_{t.name.lower()}_grid", packed)


def _entry(b, table, idx):
    """Grid entry ``idx`` (i32) of a packed grid table."""
    return b.load(b.gep(table, [ir.Constant(I32, 0), b.zext(idx, I64)]))


def _indices(b, grid, p, at_qs: int, at_qh: int, shifts: list, mask: int):
    """Grid entries of len(shifts) indices qs[k] | ((qh << shifts[k]) & mask) (the bytes qs at
    ``at_qs``, the high bits from the byte at ``at_qh``), the indices formed in one vector."""
    n = len(shifts)
    lo = b.zext(load(b, p, at_qs, vec(I8, n)), vec(I32, n))
    high = b.shl(splat(b, _byte(b, p, at_qh), n), ir.Constant(vec(I32, n), shifts))
    idx = b.or_(lo, b.and_(high, ir.Constant(vec(I32, n), [mask] * n)))
    return [_entry(b, grid, b.extract_element(idx, _c(k))) for k in range(n)]


def _byte(b, p, at):
    return b.zext(load(b, p, at, I8), I32)


def _c(v):
    return ir.Constant(I32, v)


def _ksign(b, ks, s):
    """ksigns_iq2xs[s] (s an i32 in 0..127) as i32."""
    return b.zext(b.load(b.gep(ks, [ir.Constant(I32, 0), b.zext(s, I64)])), I32)


def _group(b, t, p, g: int, tabs):
    """32-value group g of the block at i8* p: (magnitudes <32 x i8> (grid values, unsigned),
    sign word i32 (bit i set: value i negated), scales <16 x i16> (2s + 1 of the maddubs lane's values))."""
    grid, ks = tabs
    if t == T.IQ3_S:  # qs[64] at 2 | qh[8] at 66 | signs[32] at 74 | scales[4] at 106
        ents = _indices(b, grid, p, 2 + 8 * g, 66 + g, [8 - k for k in range(8)], 0x100)
        sign = load(b, p, 74 + 4 * g, I32)
        ls = b.and_(b.lshr(_byte(b, p, 106 + g // 2), _c(4 * (g % 2))), _c(15))
        scales = (ls, ls)
    elif t == T.IQ2_S:  # qs[32] at 2 | signs[32] at 34 | qh[8] at 66 | scales[8] at 74
        ents = _indices(b, grid, p, 2 + 4 * g, 66 + g, [8 - 2 * k for k in range(4)], 0x300)
        sign = load(b, p, 34 + 4 * g, I32)
        sc = _byte(b, p, 74 + g)
        scales = (b.and_(sc, _c(15)), b.lshr(sc, _c(4)))
    elif t == T.IQ2_XS:  # u16 qs[32] at 2 (9-bit grid index, 7-bit sign index) | scales[8] at 66
        qs = [b.zext(load(b, p, 2 + 8 * g + 2 * k, I16), I32) for k in range(4)]
        ents = [_entry(b, grid, b.and_(q, _c(511))) for q in qs]
        sign = _sign_word(b, [_ksign(b, ks, b.lshr(q, _c(9))) for q in qs])
        sc = _byte(b, p, 66 + g)
        scales = (b.and_(sc, _c(15)), b.lshr(sc, _c(4)))
    else:  # IQ2_XXS (u32 grid bytes, u32 signs + scale per 32) / IQ3_XXS (qs[64] at 2, u32 at 66 + 4g)
        xxs2 = t == T.IQ2_XXS
        a1 = load(b, p, 6 + 8 * g if xxs2 else 66 + 4 * g, I32)
        if xxs2:
            ents = [_byte(b, p, 2 + 8 * g + k) for k in range(4)]
        else:
            ents = [_byte(b, p, 2 + 8 * g + k) for k in range(8)]
        ents = [_entry(b, grid, i) for i in ents]
        sign = _sign_word(b, [_ksign(b, ks, b.and_(b.lshr(a1, _c(7 * k)), _c(127))) for k in range(4)])
        ls = b.lshr(a1, _c(28))
        scales = (ls, ls)
    ety = ents[0].type
    v = ir.Constant(vec(ety, len(ents)), None)
    for k, e in enumerate(ents):
        v = b.insert_element(v, e, _c(k))
    mag = b.bitcast(v, V32I8)
    s16 = [b.trunc(b.add(b.shl(s, _c(1)), _c(1)), I16) for s in scales]
    lo, hi = splat(b, s16[0], 16), splat(b, s16[1], 16)
    sc16 = lo if scales[0] is scales[1] else shuffle(b, lo, list(range(8)) + list(range(24, 32)), hi)
    return mag, sign, sc16


def _sign_word(b, bytes4):
    """i32 of four sign bytes (byte k in bits 8k..8k+7)."""
    w = bytes4[0]
    for k in range(1, 4):
        w = b.or_(w, b.shl(bytes4[k], _c(8 * k)))
    return w


_SPREAD = [k for k in range(4) for _ in range(8)]  # vpshufb: byte i of a broadcast word -> lane i // 8
_BITS = [1 << (i % 8) for i in range(32)]


def _apply_signs(b, x, sign):
    """x <32 x i8> with lane i negated where bit i of ``sign`` is set (broadcast, vpshufb, and, cmpeq, xor / sub)."""
    spread = _x86_call(b, "llvm.x86.avx2.pshuf.b", [b.bitcast(splat(b, sign, 8), V32I8),
                                                    ir.Constant(V32I8, _SPREAD)])
    bits = ir.Constant(V32I8, _BITS)
    m = b.sext(b.icmp_unsigned("==", b.and_(spread, bits), bits), V32I8)
    return b.sub(b.xor(x, m), m)


def _block(b, t, path, rows, blk, accs, x16: bool, tabs):
    """One 256-value weight block of every (weight row r, activation row tt), output i = r * nt + tt."""
    row = TYPES[t]
    nr, nt = len(rows["w"]), len(rows["xq"])
    n = nr * nt
    ptrs = [b.gep(w, [b.mul(blk, ir.Constant(I64, row.type_size))]) for w in rows["w"]]
    dws = [load_half(b, p, 0) for p in ptrs]
    dxs = [load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32) for xd in rows["xd"]]
    x_at = b.mul(blk, ir.Constant(I64, 256))
    lanes = [None] * n
    for g in range(8):
        xs = [_quants(b, xq, b.add(x_at, ir.Constant(I64, 32 * g)), x16) for xq in rows["xq"]]
        for r, p in enumerate(ptrs):
            mag, sign, sc16 = _group(b, t, p, g, tabs)
            for tt in range(nt):
                p16 = madd_u8_s8_256(b, mag, _apply_signs(b, xs[tt], sign))
                part = _x86_madd(b, p16, sc16)
                i = r * nt + tt
                lanes[i] = part if lanes[i] is None else b.add(lanes[i], part)
    new = dict(accs)
    if path == VEC_DOT:
        new["acc"] = [fmuladd(b, b.sitofp(lanes[i], V8F32), splat(b, b.fmul(dws[i // nt], dxs[i % nt]), 8),
                              accs["acc"][i]) for i in range(n)]
        return new
    factor = ir.Constant(F32, FACTOR[t])
    dwf = [b.fmul(d, factor) for d in dws]
    res = []
    for g, v in enumerate(_totals(b, lanes)):
        dw = _by_output(b, [dwf[i // nt] for i in range(n)], n, g)
        dx = _by_output(b, [dxs[i % nt] for i in range(n)], n, g)
        res.append(fmuladd(b, b.fmul(dw, b.sitofp(v, V8F32)), dx, accs["acc"][g]))
    new["acc"] = res
    return new


def build_avx2_iq23_tile(module: ir.Module, t: T, path: int, nr: int, nt: int, name: str, x16: bool) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)`` as kernels_cpu.matmul_tiles.build_tile's frame, for (``t``, ``path``) in
    AVX2_IQ23_PATHS, ``nr`` weight rows x ``nt`` activation rows (Q8_K quants int8, or int16
    when ``x16``; the bsums ``xa`` unused)."""
    assert (t, path) in AVX2_IQ23_PATHS, (t, path)
    n = nr * nt
    tabs = (_grid_table(module, t), _table(module, "edge_iq2xs_ksigns", KSIGNS))
    zeros = [ir.Constant(V8F32, [0.0] * 8)] * (n if path == VEC_DOT else (n + 7) // 8)
    factor = ir.Constant(F32, FACTOR[t])

    def body(b, rows, blk, accs):
        return _block(b, t, path, rows, blk, accs, x16, tabs)

    def finish(b, new):
        out = {}
        if path == VEC_DOT:  # factor * hsum_float_8
            for i, v in enumerate(new["acc"]):
                s = hsum_float_8(b, v)
                out[divmod(i, nt)] = s if FACTOR[t] == 1.0 else b.fmul(factor, s)
            return out
        for i, (g, lane) in enumerate(_lane_map(n)):
            out[divmod(i, nt)] = b.extract_element(new["acc"][g], _c(lane))
        return out

    return tile_function(module, name, nr, nt, {"acc": zeros}, body, finish, TYPES[t].type_size)
