"""IQ1_S / IQ1_M / TQ1_0 / TQ2_0 matmul tiles for x86 CPUs with AVX2: per 32-value group of a
weight row its codes in one <32 x i8> vector (IQ1: four iq1s_grid rows by scalar loads, at byte
offsets computed for the whole block in one vector; TQ1_0: base-3 trits by 16-bit multiplies;
TQ2_0: 2-bit fields by shifts), products with ``vpmaddubsw`` (IQ1: scale bytes times the quants
signed by the grid, ``vpsignb``) summed in int16 over the 8 groups of a block, then ``vpmaddwd``
into ggml's 8 int32 lanes, as the __AVX2__ branches of ggml_vec_dot_iq1_s_q8_K, _iq1_m_, _tq1_0_
and _tq2_0_q8_K (ggml-cpu/arch/x86/quants.c). They run on every AVX2 CPU, with AVX-512 too (no
other vector kernel covers these types).

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
from kernels_cpu.iq23_avx2 import Format, _c, _table
from kernels_cpu.matmul_avx2 import _quants
from kernels_cpu.matmul_tiles import TILED, VEC_DOT
from kernels_cpu.simd import (BYTE_PTR, F32, I8, I16, I32, I64, _x86_call, fma, hsum_float_8, load, load_half,
                              madd_u8_s8_256, shuffle, sign_i8_256, splat, sum_pairs_i16_256, tile_function, vec)

V8I32, V8F32, V16I16, V32I16 = vec(I32, 8), vec(F32, 8), vec(I16, 16), vec(I16, 32)
V32I8, V4I64 = vec(I8, 32), vec(I64, 4)
AVX2_IQ1TQ_PATHS = frozenset({(T.IQ1_S, VEC_DOT), (T.IQ1_S, TILED), (T.IQ1_M, VEC_DOT), (T.IQ1_M, TILED),
                              (T.TQ1_0, VEC_DOT), (T.TQ2_0, VEC_DOT)})
FORMATS = {t: Format(t) for t in (T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0)}
DELTA = 0.125  # IQ1S_DELTA = IQ1M_DELTA


def _signed(b, mag, neg):
    """mag where neg is 0, -mag where neg is -1 (integer vectors of one type)."""
    return b.sub(b.xor(mag, neg), neg)


def _iq1m_d(b, p):
    """float32 scale of the IQ1_M block at p: the f16 whose nibbles are the top nibbles of scales[0..3]."""
    sc = [b.zext(load(b, p, 48 + 2 * k, I16), I32) for k in range(4)]
    bits = b.or_(b.or_(b.lshr(sc[0], _c(12)), b.and_(b.lshr(sc[1], _c(8)), _c(0xF0))),
                 b.or_(b.and_(b.lshr(sc[2], _c(4)), _c(0xF00)), b.and_(sc[3], _c(0xF000))))
    return b.fpext(b.bitcast(b.trunc(bits, I16), ir.HalfType()), F32)


def _pshufb(b, v, mask):
    """vpshufb ymm: byte i of the result = byte mask[i] of v's 128-bit half holding lane i."""
    return _x86_call(b, "llvm.x86.avx2.pshuf.b", [v, ir.Constant(V32I8, mask)])


def _u16_lanes(b, v, lanes, mul):
    """<32 x i16>: lane k = v[lanes[k]] * mul[k] (mod 2**16; v a vector of i16)."""
    return b.mul(shuffle(b, v, lanes), ir.Constant(V32I16, mul))


def _iq1_block(b, t, p, slot):
    """Decode the IQ1 block at p into what its 8 groups need: the byte offsets of its 32 grid rows
    (8 * index, stored to the i16[32] at ``slot``, read back by _iq1_group), and <32 x i8> sources
    for _iq1_group's vpshufb: the scales 2s + 1 (IQ1_S: ls_ib in byte ib of each half; IQ1_M: the
    16 scales of 16 values), and IQ1_M: the delta signs +1 / -1 of each 8 values (32: 4ib + 0, 1 in
    bytes 2ib, 2ib + 1 of the low half, 4ib + 2, 3 of the high half), IQ1_S: <16 x i16> scale *
    delta sign of each bsums entry (for the delta term's vpmaddwd). IQ1_S blocks: d | qs[32] at
    2 | u16 qh[8] at 34 (3 index bits per 8 values, in bits 12..15 the scale and the sign);
    IQ1_M: qs[32] | qh[16] at 32 (a nibble per 8 values: 3 index bits, the sign) | u16 scales[4] at 48."""
    qs = b.shl(b.zext(load(b, p, 2 if t == T.IQ1_S else 0, V32I8), V32I16), ir.Constant(V32I16, [3] * 32))
    if t == T.IQ1_S:
        qh = load(b, p, 34, vec(I16, 8))
        high = _u16_lanes(b, qh, [k // 4 for k in range(32)], [1 << (11 - 3 * (k % 4)) for k in range(32)])
        ls = b.or_(b.and_(b.lshr(qh, ir.Constant(vec(I16, 8), [11] * 8)), ir.Constant(vec(I16, 8), [14] * 8)),
                   ir.Constant(vec(I16, 8), [1] * 8))
        ss = _signed(b, ls, b.ashr(qh, ir.Constant(vec(I16, 8), [15] * 8)))  # scale * delta sign, per 32 values
        scales = shuffle(b, b.trunc(ls, vec(I8, 8)), list(range(8)) * 4)
        signs = shuffle(b, ss, [k // 2 for k in range(16)])
    else:
        qh8 = load(b, p, 32, vec(I8, 16))
        high = _u16_lanes(b, b.zext(qh8, vec(I16, 16)), [k // 2 for k in range(32)], [1 << 11, 1 << 7] * 16)
        sc = load(b, p, 48, vec(I16, 4))
        ls = b.lshr(_u16_lanes(b, sc, [j // 4 for j in range(16)] * 2, [1 << (13 - 3 * (j % 4)) for j in range(32)]),
                    ir.Constant(V32I16, [12] * 32))
        scales = b.trunc(b.or_(ls, ir.Constant(V32I16, [1] * 32)), V32I8)
        half = shuffle(b, qh8, [2 * ((j % 16) // 2) + (j >= 16) for j in range(32)])
        bit = ir.Constant(V32I8, [8, 0x80] * 16)
        neg = b.icmp_unsigned("==", b.and_(half, bit), bit)
        signs = b.select(neg, ir.Constant(V32I8, [-1] * 32), ir.Constant(V32I8, [1] * 32))
    offs = b.or_(qs, b.and_(high, ir.Constant(V32I16, [0x3800] * 32)))
    b.store(offs, slot, align=32)
    return scales, signs


class _VolatileLoad(ir.instructions.LoadInstr):
    """``load volatile``: kept as a load (LLVM would forward the stored vector's lanes into
    vpextrw extracts, two uops each against one for a load)."""

    def descr(self, buf):
        super().descr(buf)
        buf[-1] = buf[-1].replace("load ", "load volatile ", 1)


def _volatile_load(b, ptr, align: int):
    instr = _VolatileLoad(b.block, ptr)
    instr.align = align
    b._insert(instr)
    return instr


def _iq1_group(b, t, g: int, grid, slot, scales, signs):
    """32-value group g of an IQ1 block decoded by _iq1_block: (grid values <32 x i8>, scale bytes
    <32 x i8> (2s + 1 of each value), IQ1_M: delta signs <32 x i8> (+1 / -1 of each value), else None).
    The grid rows are read at offsets loaded from ``slot``."""
    offsets = b.bitcast(slot, I16.as_pointer())
    v = ir.Constant(V4I64, None)
    for k in range(4):
        off = _volatile_load(b, b.gep(offsets, [_c(4 * g + k)]), 2)
        row = b.bitcast(b.gep(b.bitcast(grid, BYTE_PTR), [b.zext(off, I64)]), I64.as_pointer())
        v = b.insert_element(v, b.load(row, align=8), _c(k))
    if t == T.IQ1_S:
        return b.bitcast(v, V32I8), _pshufb(b, scales, [g] * 32), None
    pair = [2 * g] * 8 + [2 * g + 1] * 8
    return b.bitcast(v, V32I8), _pshufb(b, scales, [2 * g] * 16 + [2 * g + 1] * 16), _pshufb(b, signs, pair * 2)


def _trits(b, q, pows):
    """<32 x i8> trits ((uint8)(q * p) * 3) >> 8 (dequantize_row_tq1_0) of the bytes q, p = pows[i]
    for bytes 2i, 2i + 1: the even and odd bytes apart in 16-bit lanes, (q p mod 256) << 8 by
    vpmullw, the trit in the high half of the product with 3 (vpmulhuw)."""
    q16 = b.bitcast(q, V16I16)
    three = _i16([3] * 16)
    even = b.mul(b.and_(q16, _i16([0xFF] * 16)), _i16(256 * p for p in pows))
    odd = b.mul(b.and_(q16, _i16([0xFF00] * 16)), _i16(pows))
    t_even = _x86_call(b, "llvm.x86.avx2.pmulhu.w", [even, three])
    t_odd = b.shl(_x86_call(b, "llvm.x86.avx2.pmulhu.w", [odd, three]), _i16([8] * 16))
    return b.bitcast(b.or_(t_even, t_odd), V32I8)


def _i16(values):
    return ir.Constant(V16I16, list(values))


def _tq_codes(b, t, p):
    """The 8 groups' <32 x i8> codes (TQ1_0 trits 0..2, TQ2_0 0..3) of the block at p, value
    32 g + i in byte i of group g (kernels_cpu.iq1tq._tq1_codes / _tq2_codes)."""
    if t == T.TQ2_0:  # value 128 j + 32 l + m: bits 2l of qs[32 j + m]
        return [b.and_(b.lshr(load(b, p, 32 * (g // 4), V32I8), ir.Constant(V32I8, [2 * (g % 4)] * 32)),
                       ir.Constant(V32I8, [3] * 32)) for g in range(8)]
    q = load(b, p, 0, V32I8)  # groups 0..4: qs[0:32] x 3**g
    x = shuffle(b, load(b, p, 32, vec(I8, 16)), list(range(16)) * 2)  # groups 5, 6: qs[32:48] x 3**(2g-10) | 3**(2g-9)
    qh = shuffle(b, load(b, p, 48, vec(I8, 4)), list(range(4)) * 4)  # group 7: qs[32:48] x 81 | qh[k % 4] x 3**(k // 4)
    codes = [_trits(b, q, [3 ** g] * 16) for g in range(5)]
    codes += [_trits(b, x, [3 ** (2 * g - 10)] * 8 + [3 ** (2 * g - 9)] * 8) for g in (5, 6)]
    codes.append(_trits(b, shuffle(b, shuffle(b, x, range(16)), range(32), qh),
                        [81] * 8 + [3 ** (i // 2) for i in range(8)]))
    return codes


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
    p16, d16, lanes2 = [None] * n, [None] * n, [None] * n
    if iq1:
        entry = ir.IRBuilder(b.block.parent.entry_basic_block)
        entry.position_at_start(b.block.parent.entry_basic_block)
        slots = [entry.alloca(V32I16) for _ in ptrs]
        srcs = [_iq1_block(b, t, p, slot) for p, slot in zip(ptrs, slots)]
    else:
        tq_codes = [_tq_codes(b, t, p) for p in ptrs]
    # IQ1 decode tiles (nt = 1) a row at a time: with the groups outermost LLVM loaded all rows'
    # grid entries early and spilled them (IQ1_M 19 -> 15 ns per block-row); else a group at a time
    by_row = iq1 and nt == 1
    order = [(g, r) for r in range(nr) for g in range(8)] if by_row else [(g, r) for g in range(8) for r in range(nr)]
    for g, r in order:
        xs = [_quants(b, xq, b.add(x_at, ir.Constant(I64, 32 * g)), x16) for xq in rows["xq"]]
        if iq1:
            vals, scale8, sign8 = _iq1_group(b, t, g, grid, slots[r], *srcs[r])
        for tt in range(nt):
            i = r * nt + tt
            if iq1:
                part = madd_u8_s8_256(b, scale8, sign_i8_256(b, xs[tt], vals))
            else:
                part = madd_u8_s8_256(b, tq_codes[r][g], xs[tt])
            p16[i] = part if p16[i] is None else b.add(p16[i], part)
            if t == T.IQ1_M:  # scale * delta sign * y
                part = madd_u8_s8_256(b, scale8, sign_i8_256(b, xs[tt], sign8))
                d16[i] = part if d16[i] is None else b.add(d16[i], part)
    lanes = [sum_pairs_i16_256(b, v) for v in p16]
    if t == T.IQ1_M:
        lanes2 = [sum_pairs_i16_256(b, v) for v in d16]
    elif t == T.IQ1_S:  # per output <8 x i32> whose total is sum over ib of scale * sign * (bsums 2ib, 2ib+1)
        lanes2 = [_x86_madd(b, bsums[i % nt], srcs[i // nt][1]) for i in range(n)]
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
