"""Panel matmul kernels for many activation rows (prefill, batched decode, verification), for
CPUs with AVX-512 VNNI: 16 weight rows, one per lane of a zmm vector, times any number of
activation rows.

A panel decodes each weight block of its 16 rows once (codes transposed so that lane r holds
row r's; kernels_cpu.matmul_rows does it for 8 rows, twice here) and then runs every activation
row of the call through it: ``vpdpbusd`` zmm of the codes with 4 activation quants broadcast to
all lanes, the exact integer totals, and the float update of the path, lane-wise. The float
accumulators of the activation rows live in a stack buffer (L1) across the blocks, so the cost
of decoding a block is shared by all the rows and the integer products run at close to the
CPU's int8 throughput. The float operations per output are those of the 8-row tiles of
kernels_cpu.matmul_rows in the same order: results are bit-identical to them.

Paths: GEMV for Q8_0 / Q5_0 / Q4_0 / IQ4_NL / MXFP4 (acc = fma(I, d_w * d_x, acc) per 32-value
block, I the exact block total from -offset * the block's activation sum, as
matmul_rows.q0_codes makes the codes unsigned); Q4_K GEMV / GEMM (llama.cpp's repacked q4_K
gemv / gemm) and TILED; Q5_K, Q6_K and IQ4_XS TILED (llama.cpp's tiled kernel, T >= 8).

numba's on-disk cache keys matmul's kernels on matmul_kernels.py only: after editing this module,
clear kernels_cpu/__pycache__/matmul_kernels.*.nbi / .nbc.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType
from llvmlite import ir

from kernels_cpu.ggml_types import TYPES
from kernels_cpu.iq4_decoders import KVALUES_IQ4NL
from kernels_cpu.matmul_rows import (IQ4_XS_BYTES, _Act, Q0_ROWS, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, ROWS, _byte,
                                     _halves_to_f32, _i16_pair, _load_rows, _nibble_chunks, _q6_k_codes, q0_codes,
                                     q0_words)
from kernels_cpu.simd import (BYTE_PTR, F32, I8, I16, I32, I64, concat, dot_i16, dot_u8_s8, fmuladd, load, prefetch,
                              shuffle, splat, vec)

_IQ4_XS_QS = TYPES[GGMLQuantizationType.IQ4_XS].offset("qs")
PANEL_ROWS = 16     # weight rows per panel: one per lane of a <16 x i32> (zmm) vector
PANEL_T = 64        # most activation rows per panel call (the stack accumulators: 4 KB each)
GROUP = 4           # activation rows sharing each loaded code vector
V16I32, V16F32, V64I8, V32I16 = vec(I32, PANEL_ROWS), vec(F32, PANEL_ROWS), vec(I8, 64), vec(I16, 32)


def _loop(b: ir.IRBuilder, fn: ir.Function, start, stop, step: int, body, name: str):
    """Emit ``for (i = start; i + step <= stop; i += step) body(b, i)``; returns the i after the
    loop (i64). ``body`` may add blocks; the builder ends positioned after the loop."""
    head, work, done = (fn.append_basic_block(f"{name}_{k}") for k in ("head", "body", "done"))
    pre = b.block
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64)
    i.add_incoming(start, pre)
    b.cbranch(b.icmp_signed("<=", b.add(i, ir.Constant(I64, step)), stop), work, done)
    b.position_at_end(work)
    body(b, i)
    i.add_incoming(b.add(i, ir.Constant(I64, step)), b.block)
    b.branch(head)
    b.position_at_end(done)
    return i


def _splat16(b, value):
    return splat(b, value, PANEL_ROWS)


def _quad(b, xq, at, x16: bool):
    """<64 x i8>: the 4 activation quants at value index ``at`` (i64) of row xq, in every lane
    (int8 quants, or with ``x16`` int16 ones narrowed)."""
    if x16:
        word = b.bitcast(b.trunc(load(b, xq, b.mul(at, ir.Constant(I64, 2)), vec(I16, 4)), vec(I8, 4)), I32)
    else:
        word = load(b, xq, at, I32)
    return b.bitcast(_splat16(b, word), V64I8)


def _q0_decode(name):
    def decode(b, w_rows, blk, scratch):
        at = b.mul(blk, ir.Constant(I64, Q0_ROWS[name][0]))
        return q0_codes(b, name, _both(b, [b.gep(p, [at]) for p in w_rows], lambda r8: q0_words(b, name, r8)))

    def rows(b, state, xs, blk, accs, x16):
        codes, d = state
        totals = [_splat16(b, load(b, xa, b.mul(blk, ir.Constant(I64, 4)), I32)) for _, _, xa in xs]  # -offset * sum
        q_at = b.mul(blk, ir.Constant(I64, 32))
        for c, v in enumerate(codes):   # the activation rows interleaved: independent vpdpbusd chains
            totals = [dot_u8_s8(b, total, b.bitcast(v, V64I8), _quad(b, xq, b.add(q_at, ir.Constant(I64, 4 * c)), x16))
                      for total, (xq, _, _) in zip(totals, xs)]
        out = []
        for total, (_, xd, _), acc in zip(totals, xs, accs):
            d_x = _splat16(b, load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32))
            out.append([fmuladd(b, b.sitofp(total, V16F32), b.fmul(d, d_x), acc[0])])
        return out

    return decode, rows, 1, lambda b, accs: accs[0], 0


def _both(b, w_rows, fn):
    """fn(rows 0..7) and fn(rows 8..15), each a list of <8 x ...> vectors, joined lane-wise."""
    return [concat(b, lo, hi) for lo, hi in zip(fn(w_rows[:ROWS]), fn(w_rows[ROWS:]))]


def _stash(b, scratch, vectors) -> list:
    """Store vectors in the panel's code buffer; returns their slots (pointers)."""
    slots = [b.gep(scratch, [ir.Constant(I64, k)]) for k in range(len(vectors))]
    for v, slot in zip(vectors, slots):
        b.store(b.bitcast(v, V16I32), slot, align=64)
    return slots


def _c16(value: int):
    return ir.Constant(V16I32, [value] * PANEL_ROWS)


class _KAct:
    """Activation row of a Q8_K block (quants, d_x, bsums) for the K-quant panels."""

    def __init__(self, b, x, blk, x16):
        xq, xd, xa = x
        self.b, self.xq, self.x16 = b, xq, x16
        self.x_at = b.mul(blk, ir.Constant(I64, 256))
        self.d = _splat16(b, load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32))
        self.bsums = load(b, xa, b.mul(blk, ir.Constant(I64, 32)), vec(I16, 16))

    def bsum_pair(self, k: int, step: int = 1):
        """matmul_rows._Act.bsum_pair in 16 lanes, as <32 x i16> for dot_i16."""
        return self.b.bitcast(_Act.bsum_pair(self, k, step, PANEL_ROWS), V32I16)


def _dots(b, acts: list, slots, offset: int, starts=None) -> list:
    """Per activation row a: starts[a] (default 0) + sum over chunks c of vpdpbusd(codes in
    slots[c], quants offset + 4c .. offset + 4c + 3 of a); each code vector loaded once."""
    accs = list(starts) if starts is not None else [_c16(0)] * len(acts)
    for c, slot in enumerate(slots):
        code = b.bitcast(b.load(slot, align=64), V64I8)
        for i, a in enumerate(acts):
            accs[i] = dot_u8_s8(b, accs[i], code, _quad(b, a.xq, b.add(a.x_at, ir.Constant(I64, offset + 4 * c)), a.x16))
    return accs


def _q4_k(kind, q5: bool = False):
    """Q4_K, ggml_gemv_q4_K_8x8_q8_K ("gemv": one float update per 256 values) or
    ggml_gemm_q4_K_8x8_q8_K ("gemm": per 64), as matmul_rows._q4_k_block; or ("tiled") Q4_K /
    with ``q5`` Q5_K (bit 4 of value 32j + i: bit j of qh[i]) through tiled_run_micro_vnni_8x16's
    arithmetic, as kernels_cpu.matmul_tiles' TILED path: exact totals S1 (codes times sub-block
    scales) and S2 (mins times 32-value activation sums), r = S1 * d_w, r = fma(-dmin, S2, r),
    acc = fma(r, d_x, acc)."""
    block_bytes, qs_at = (Q5_K_BYTES, 48) if q5 else (Q4_K_BYTES, 16)

    def decode(b, w_rows, blk, scratch):
        at = b.mul(blk, ir.Constant(I64, block_bytes))
        rows = [b.gep(p, [at]) for p in w_rows]

        h0, u0, u1, u2 = _both(b, rows, lambda r8: _load_rows(b, r8, 0, 4))    # 16 lanes from here on
        sc_lo = b.and_(u0, _c16(0x3F3F3F3F))
        sc_hi = b.or_(b.and_(u2, _c16(0x0F0F0F0F)), b.shl(b.and_(b.lshr(u0, _c16(6)), _c16(0x03030303)), _c16(4)))
        mn_lo = b.and_(u1, _c16(0x3F3F3F3F))
        mn_hi = b.or_(b.and_(b.lshr(u2, _c16(4)), _c16(0x0F0F0F0F)),
                      b.shl(b.and_(b.lshr(u1, _c16(6)), _c16(0x03030303)), _c16(4)))
        scales = [_byte(b, w, k) for w in (sc_lo, sc_hi) for k in range(4)]
        mins = [_byte(b, w, k) for w in (mn_lo, mn_hi) for k in range(4)]
        rest = scales + [_i16_pair(b, mins[2 * p], mins[2 * p + 1]) for p in range(4)]
        d, dmin = _halves_to_f32(b, h0, 0), _halves_to_f32(b, h0, 16)
        qh = _both(b, rows, lambda r8: _load_rows(b, r8, 16, 8)) if q5 else None
        codes = []
        for p in range(4):
            raw = _both(b, rows, lambda r8, p=p: _load_rows(b, r8, qs_at + 32 * p, 8))
            low = [b.and_(v, _c16(0x0F0F0F0F)) for v in raw]
            high = [b.and_(b.lshr(v, _c16(4)), _c16(0x0F0F0F0F)) for v in raw]
            if q5:  # qh bytes 4c..4c+3 in word c: bit j of each is bit 4 of sub-block j's value
                bit = lambda v, j: b.shl(b.and_(b.lshr(v, _c16(j)), _c16(0x01010101)), _c16(4))  # noqa: E731
                low = [b.or_(v, bit(h, 2 * p)) for v, h in zip(low, qh)]
                high = [b.or_(v, bit(h, 2 * p + 1)) for v, h in zip(high, qh)]
            codes += low + high
        return d, dmin, rest[:8], rest[8:], _stash(b, scratch, codes)

    def rows(b, state, xs, blk, accs, x16):
        d, dmin, scales, min_pairs, slots = state
        acts = [_KAct(b, x, blk, x16) for x in xs]
        out = [list(a) for a in accs]
        d_wx, dmin_x = [b.fmul(d, a.d) for a in acts], [b.fmul(dmin, a.d) for a in acts]
        tot_i, tot_m = [None] * len(acts), [None] * len(acts)
        for p in range(4):
            s_lo = _dots(b, acts, slots[16 * p:16 * p + 8], 64 * p)
            s_hi = _dots(b, acts, slots[16 * p + 8:16 * p + 16], 64 * p + 32)
            for t, a in enumerate(acts):
                i_sum = b.add(b.mul(s_lo[t], scales[2 * p]), b.mul(s_hi[t], scales[2 * p + 1]))
                tot_i[t] = i_sum if tot_i[t] is None else b.add(tot_i[t], i_sum)
                tot_m[t] = dot_i16(b, _c16(0) if tot_m[t] is None else tot_m[t], b.bitcast(min_pairs[p], V32I16),
                                   a.bsum_pair(4 * p, 2))
                if kind == "tiled" and p == 3:
                    r = fmuladd(b, b.fneg(dmin), b.sitofp(tot_m[t], V16F32), b.fmul(b.sitofp(tot_i[t], V16F32), d))
                    out[t][0] = fmuladd(b, r, a.d, out[t][0])
                elif kind == "gemm" or p == 3:
                    out[t][0] = fmuladd(b, b.sitofp(tot_i[t], V16F32), d_wx[t], out[t][0])
                    out[t][1] = fmuladd(b, b.sitofp(tot_m[t], V16F32), dmin_x[t], out[t][1])
                    tot_i[t] = tot_m[t] = None
        return out

    if kind == "tiled":
        return decode, rows, 1, lambda b, accs: accs[0], 64
    return decode, rows, 2, lambda b, accs: b.fsub(accs[0], accs[1]), 64


def _q6_k_tiled():
    """Q6_K, tiled_run_micro_vnni_8x16's arithmetic (exact block total S1, r = S1 * d_w, acc =
    fma(r, d_x, acc)): as matmul_rows._q6_k_block."""

    def decode(b, w_rows, blk, scratch):
        at = b.mul(blk, ir.Constant(I64, Q6_K_BYTES))
        rows = [b.gep(p, [at]) for p in w_rows]

        def head(r8):
            d = _halves_to_f32(b, _load_rows(b, r8, 194, 4)[3], 16)
            sw = _load_rows(b, r8, 192, 4)
            scales = [_byte(b, sw[k // 4], k % 4, signed=True) for k in range(16)]
            return [d, *scales, *[_i16_pair(b, scales[2 * k], scales[2 * k + 1]) for k in range(8)]]

        d, *rest = _both(b, rows, head)
        codes = []
        for (offset, lo), (_, hi) in zip(_q6_k_codes(b, rows[:ROWS]), _q6_k_codes(b, rows[ROWS:])):
            codes += [concat(b, x, y) for x, y in zip(lo, hi)]     # 32 values from ``offset``, in order
        return d, rest[:16], rest[16:], _stash(b, scratch, codes)

    def rows(b, state, xs, blk, accs, x16):
        d, scales, pairs, slots = state
        acts = [_KAct(b, x, blk, x16) for x in xs]
        corr = [None] * len(acts)
        for t, a in enumerate(acts):
            for m in range(8):
                corr[t] = dot_i16(b, _c16(0) if corr[t] is None else corr[t], b.bitcast(pairs[m], V32I16),
                                  a.bsum_pair(2 * m))
        s1 = [None] * len(acts)
        for k, offset in enumerate(_Q6_K_OFFSETS):
            g = offset // 16
            for half in range(2):
                parts = _dots(b, acts, slots[8 * k + 4 * half:8 * k + 4 * half + 4], offset + 16 * half)
                for t, part in enumerate(parts):
                    part = b.mul(part, scales[g + half])
                    s1[t] = part if s1[t] is None else b.add(s1[t], part)
        return [[fmuladd(b, b.fmul(b.sitofp(b.sub(s1[t], b.shl(corr[t], _c16(5))), V16F32), d), a.d, accs[t][0])]
                for t, a in enumerate(acts)]

    return decode, rows, 1, lambda b, accs: accs[0], 64


def _iq4_xs_tiled():
    """IQ4_XS, the tiled kernel (as matmul_rows._iq4_xs_block): S = sum_j (ls_j - 32) * I_j over
    the 8 sub-blocks of 32 values (I_j exact: codes table value + 128 from -128 * the sub-block's
    activation sum), r = float(S) * d_w, acc = fma(r, d_x, acc)."""

    def decode(b, w_rows, blk, scratch):
        at = b.mul(blk, ir.Constant(I64, IQ4_XS_BYTES))
        rows = [b.gep(p, [at]) for p in w_rows]
        head0, sl = _both(b, rows, lambda r8: _load_rows(b, r8, 0, 4)[:2])     # d | scales_h, scales_l[4]
        sh = b.lshr(head0, _c16(16))
        scales = [b.sub(b.or_(b.and_(b.lshr(sl, _c16(8 * (j // 2) + 4 * (j % 2))), _c16(0xF)),
                              b.shl(b.and_(b.lshr(sh, _c16(2 * j)), _c16(3)), _c16(4))), _c16(32)) for j in range(8)]
        codes = []
        for j in range(8):
            qs = _both(b, rows, lambda r8, j=j: _load_rows(b, r8, _IQ4_XS_QS + 16 * j, 4))
            codes += _nibble_chunks(b, qs, KVALUES_IQ4NL)
        return _halves_to_f32(b, head0, 0), scales, _stash(b, scratch, codes)

    def rows(b, state, xs, blk, accs, x16):
        d, scales, slots = state
        acts = [_KAct(b, x, blk, x16) for x in xs]
        totals = [None] * len(acts)
        for j in range(8):
            starts = []
            for a in acts:
                pair = b.sext(shuffle(b, a.bsums, [2 * j, 2 * j + 1]), vec(I32, 2))
                total = b.add(b.extract_element(pair, ir.Constant(I32, 0)), b.extract_element(pair, ir.Constant(I32, 1)))
                starts.append(_splat16(b, b.mul(total, ir.Constant(I32, -128))))
            for t, part in enumerate(_dots(b, acts, slots[8 * j:8 * j + 8], 32 * j, starts)):
                part = b.mul(part, scales[j])
                totals[t] = part if totals[t] is None else b.add(totals[t], part)
        return [[fmuladd(b, b.fmul(b.sitofp(total, V16F32), d), a.d, acc[0])]
                for total, a, acc in zip(totals, acts, accs)]

    return decode, rows, 1, lambda b, accs: accs[0], 64


_Q6_K_OFFSETS = [128 * half + 32 * g for half in range(2) for g in (0, 2, 1, 3)]  # matmul_rows._q6_k_codes' order

PANEL_TYPES = {("gemv", name): _q0_decode(name) for name in Q0_ROWS}
PANEL_TYPES.update({("gemv", "Q4_K"): _q4_k("gemv"), ("gemm", "Q4_K"): _q4_k("gemm"), ("tiled", "Q4_K"): _q4_k("tiled"),
                    ("tiled", "Q5_K"): _q4_k("tiled", q5=True), ("tiled", "Q6_K"): _q6_k_tiled(),
                    ("tiled", "IQ4_XS"): _iq4_xs_tiled()})


def build_panel(module: ir.Module, ggml_type_name: str, kind: str, name: str, x16: bool = False) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    nt, nb)``: out[t * out_stride + r] = the path's dot of weight row r (at w + r * w_stride,
    r < 16) and activation row t (quants at xq + t * xq_stride, int8, or int16 with ``x16``; scales
    xd, sums xa: as kernels_cpu.matmul_tiling.qdot_tile takes them) for t < nt <= PANEL_T, over
    nb blocks."""
    decode, rows, n_acc, finish, n_codes = PANEL_TYPES[(kind, ggml_type_name)]
    args = [BYTE_PTR, I64] * 4 + [F32.as_pointer(), I64, I64, I64]
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), args), name)
    fn.linkage = "internal"
    w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride, nt, nb = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    accs = b.alloca(V16F32, ir.Constant(I64, PANEL_T * n_acc))
    accs.align = 64
    scratch = b.alloca(V16I32, ir.Constant(I64, max(n_codes, 1)))   # a block's decoded codes
    scratch.align = 64
    zero = ir.Constant(V16F32, [0.0] * PANEL_ROWS)
    w_rows = [b.gep(w, [b.mul(ir.Constant(I64, r), w_stride)]) for r in range(PANEL_ROWS)]
    zero_i = ir.Constant(I64, 0)

    def clear(b, t):
        for k in range(n_acc):
            b.store(zero, b.gep(accs, [b.add(b.mul(t, ir.Constant(I64, n_acc)), ir.Constant(I64, k))]), align=64)

    _loop(b, fn, zero_i, nt, 1, clear, "clear")

    block_bytes = TYPES[GGMLQuantizationType[ggml_type_name]].type_size
    w_next = [b.gep(w, [b.mul(ir.Constant(I64, PANEL_ROWS + r), w_stride)]) for r in range(PANEL_ROWS)]

    def block(b, blk):
        # the same block of the next panel's rows (the rows this thread takes next; may lie past
        # the matrix: a prefetch does not fault): with few activation rows the panel is bound by
        # the weight stream, whose 16 interleaved rows the hardware prefetchers follow poorly
        at = b.mul(blk, ir.Constant(I64, block_bytes))
        for p in w_next:
            for line in range(0, block_bytes, 64):
                prefetch(b, b.gep(p, [at]), line)
        state = decode(b, w_rows, blk, scratch)

        def group(b, t, n):
            ts = [b.add(t, ir.Constant(I64, i)) for i in range(n)]
            xs = [[b.gep(p, [b.mul(ti, s)]) for p, s in ((xq, xq_stride), (xd, xd_stride), (xa, xa_stride))] for ti in ts]
            ptrs = [[b.gep(accs, [b.add(b.mul(ti, ir.Constant(I64, n_acc)), ir.Constant(I64, k))]) for k in range(n_acc)]
                    for ti in ts]
            new = rows(b, state, xs, blk, [[b.load(p, align=64) for p in row] for row in ptrs], x16)
            for row, values in zip(ptrs, new):
                for p, v in zip(row, values):
                    b.store(v, p, align=64)

        t = _loop(b, fn, zero_i, nt, GROUP, lambda b, t: group(b, t, GROUP), "groups")
        _loop(b, fn, t, nt, 1, lambda b, t: group(b, t, 1), "tail")

    _loop(b, fn, zero_i, nb, 1, block, "blocks")

    def store(b, t):
        values = [b.load(b.gep(accs, [b.add(b.mul(t, ir.Constant(I64, n_acc)), ir.Constant(I64, k))]), align=64)
                  for k in range(n_acc)]
        dst = b.bitcast(b.gep(out, [b.mul(t, out_stride)]), V16F32.as_pointer())
        b.store(finish(b, values), dst, align=4)

    _loop(b, fn, zero_i, nt, 1, store, "store")
    b.ret_void()
    return fn
