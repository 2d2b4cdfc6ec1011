"""Q4_K / Q6_K (and GEMV-path Q8_0 / Q5_0 / Q4_0 / IQ4_NL / MXFP4, TILED-path IQ4_XS) matmul
tiles with one weight row per vector lane, for CPUs with AVX-512 VNNI.

The generic tiles of kernels_cpu.matmul multiply each (weight row, activation row) pair in its own
vectors and reduce them across lanes afterwards. Here a tile is 8 weight rows x nt activation
rows and lane r of every <8 x i32> / <8 x float> vector belongs to weight row r: each block's
codes of the 8 rows are transposed in registers (4-byte chunks: vector c holds chunk c of every
row), and ``vpdpbusd`` multiplies them with 4 activation quants broadcast to all lanes (u8 codes
x s8 quants, sums of 4 products per lane). Sub-block scales then multiply whole sub-block sums
(exact int32), and every float operation of llama.cpp's kernel runs lane-wise, one output per
lane, in the same order: the results are bit-identical to the generic tiles (and llama.cpp).

Paths (see kernels_cpu.matmul): Q4_K "gemv" (one group of 256 values) and "gemm" (groups of 64),
both acc = fma(I, d_w * d_x, acc), accm = fma(M, dmin * d_x, accm), out = acc - accm; Q6_K
"tiled" (r = S1 * d_w; acc = fma(r, d_x, acc)), with codes used unsigned (0..63) and the -32
offset applied through the activations' bsums (exact integers either way). Q6_K's "vec_dot"
path is in kernels_cpu.matmul_vnni.

numba's on-disk cache keys matmul's kernels on matmul_kernels.py only: after editing this module,
clear kernels_cpu/__pycache__/matmul_kernels.*.nbi / .nbc.
"""
from __future__ import annotations

from llvmlite import ir

from gguf import GGMLQuantizationType as T

from kernels_cpu.ggml_types import TYPES
from kernels_cpu.iq4_decoders import KVALUES_IQ4NL, KVALUES_MXFP4, e8m0_half, lookup16
from kernels_cpu.simd import (F32, I8, I16, I32, I64, concat, dot_i16, dot_u8_s8, fmuladd, load, shuffle, splat,
                              tile_function, vec)

ROWS = 8  # weight rows per tile: one per lane of a 256-bit vector
V8I32, V8F32, V32I8 = vec(I32, ROWS), vec(F32, ROWS), vec(I8, 32)
Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = TYPES[T.Q4_K].type_size, TYPES[T.Q5_K].type_size, TYPES[T.Q6_K].type_size


def _c(value: int, like=None):
    """Constant i32 vector of ``value`` in every lane: 8 lanes, or as many as vector ``like``."""
    n = like.type.count if like is not None else ROWS
    return ir.Constant(vec(I32, n), [value] * n)


_UNPACK32 = ([0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15])  # x86 vpunpck{l,h}dq
_UNPACK64 = ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])  # vpunpck{l,h}qdq
_HALVES = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])  # vperm2i128


def _quarter_transpose(b, v: list) -> list:
    """4 vectors <8 x i32>, v[i] = words (w0..w3 of row i | w0..w3 of row i + 4) -> 4 vectors,
    vector k = (word k of rows 0..3 | word k of rows 4..7) (4 x 4 transposes in both halves)."""
    lo01, hi01 = (shuffle(b, v[0], m, v[1]) for m in _UNPACK32)
    lo23, hi23 = (shuffle(b, v[2], m, v[3]) for m in _UNPACK32)
    return [shuffle(b, x, m, y) for x, y in ((lo01, lo23), (hi01, hi23)) for m in _UNPACK64]


def _load_rows(b, w_rows: list, offset, n_i32: int) -> list:
    """Transposed <8 x i32> vectors of ``n_i32`` (8 or 4) 4-byte words at byte ``offset`` of each
    row's block: vector c lane r = word c of row r."""
    if n_i32 == 4:  # row r and row r + 4 side by side, then 4 x 4 transposes
        return _quarter_transpose(b, [concat(b, load(b, w_rows[r], offset, vec(I32, 4)),
                                             load(b, w_rows[r + 4], offset, vec(I32, 4))) for r in range(4)])
    rows = [load(b, p, offset, V8I32) for p in w_rows]
    top, bottom = _quarter_transpose(b, rows[:4]), _quarter_transpose(b, rows[4:])  # (w_k | w_k+4) of 4 rows
    out = [None] * 8
    for k in range(4):
        out[k], out[k + 4] = (shuffle(b, top[k], m, bottom[k]) for m in _HALVES)
    return out


def _halves_to_f32(b, words, shift: int):
    """f16 stored in bits shift..shift+15 of each i32 lane -> float lanes (exact). The helpers
    from here on take <8 x i32> or <16 x i32> (kernels_cpu.matmul_panel) vectors."""
    n = words.type.count
    h = b.trunc(b.lshr(words, _c(shift, words)) if shift else words, vec(I16, n))
    return b.fpext(b.bitcast(h, vec(ir.HalfType(), n)), vec(F32, n))


def _byte(b, words, k: int, signed: bool = False):
    """Byte k of each i32 lane, zero- or sign-extended."""
    if signed:
        return b.ashr(b.shl(words, _c(24 - 8 * k, words)), _c(24, words))
    return b.and_(b.lshr(words, _c(8 * k, words)), _c(0xFF, words)) if k < 3 else b.lshr(words, _c(24, words))


def _i16_pair(b, lo, hi):
    """i32 lanes lo, hi (16-bit values) -> lanes holding the i16 pair (lo, hi) (for dot_i16)."""
    return b.or_(b.and_(lo, _c(0xFFFF, lo)), b.shl(hi, _c(16, hi)))


class _Act:
    """Activation row t of the tile: quants (int8, or int16 narrowed), scale d_x, bsums."""

    def __init__(self, b, xq, xd, xa, x16: bool, blk):
        self.b, self.xq, self.x16 = b, xq, x16
        self.x_at = b.mul(blk, ir.Constant(I64, 256))
        self.d = splat(b, load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32), ROWS)
        self.bsums = load(b, xa, b.mul(blk, ir.Constant(I64, 32)), vec(I16, 16))

    def quad(self, offset: int):
        """<8 x i32>: the 4 quants at values offset..offset+3 of the block, in every lane."""
        b = self.b
        at = b.add(self.x_at, ir.Constant(I64, offset))
        if self.x16:
            word = b.bitcast(b.trunc(load(b, self.xq, b.mul(at, ir.Constant(I64, 2)), vec(I16, 4)), vec(I8, 4)), I32)
        else:
            word = load(b, self.xq, at, I32)
        return splat(b, word, ROWS)

    def bsum_pair(self, k: int, step: int = 1, lanes: int = ROWS):
        """<lanes x i32> holding the i16 pair (bsum of group k, of group k + step) in every lane,
        where a group is 16 values (step 1) or with ``step`` 2 sums of two groups (32 values)."""
        b = self.b
        if step == 1:
            pair = shuffle(self.b, self.bsums, [k, k + 1])
        else:  # 32-value sums of sub-blocks k // 2 and k // 2 + 1 (groups k .. k + 3)
            lo, hi = shuffle(b, self.bsums, [k, k + 2]), shuffle(b, self.bsums, [k + 1, k + 3])
            pair = b.add(lo, hi)
        return splat(b, b.bitcast(pair, I32), lanes)


def _dot_chunks(b, codes: list, act: _Act, offset: int, acc=None):
    """acc + sum over chunks c of vpdpbusd(codes[c], quants offset + 4c .. offset + 4c + 3)."""
    acc = acc if acc is not None else _c(0)
    for c, v in enumerate(codes):
        acc = dot_u8_s8(b, acc, b.bitcast(v, V32I8), b.bitcast(act.quad(offset + 4 * c), V32I8))
    return acc


def _q4_k_block(b, w_rows, acts, kind, accs):
    """One Q4_K block: GEMV (one float update) or GEMM (one per 64 values)."""
    h0, u0, u1, u2 = _load_rows(b, w_rows, 0, 4)
    d, dmin = _halves_to_f32(b, h0, 0), _halves_to_f32(b, h0, 16)
    sc_lo = b.and_(u0, _c(0x3F3F3F3F))
    sc_hi = b.or_(b.and_(u2, _c(0x0F0F0F0F)), b.shl(b.and_(b.lshr(u0, _c(6)), _c(0x03030303)), _c(4)))
    mn_lo = b.and_(u1, _c(0x3F3F3F3F))
    mn_hi = b.or_(b.and_(b.lshr(u2, _c(4)), _c(0x0F0F0F0F)), b.shl(b.and_(b.lshr(u1, _c(6)), _c(0x03030303)), _c(4)))
    scales = [_byte(b, w, k) for w in (sc_lo, sc_hi) for k in range(4)]
    mins = [_byte(b, w, k) for w in (mn_lo, mn_hi) for k in range(4)]
    min_pairs = [_i16_pair(b, mins[2 * p], mins[2 * p + 1]) for p in range(4)]
    d_wx = [b.fmul(d, a.d) for a in acts]
    dmin_x = [b.fmul(dmin, a.d) for a in acts]
    acc, accm = list(accs["acc"]), list(accs["accm"])
    tot_i = [None] * len(acts)
    tot_m = [None] * len(acts)
    for p in range(4):  # sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles) of qs[32p:32p+32]
        raw = _load_rows(b, w_rows, 16 + 32 * p, 8)
        low = [b.and_(v, _c(0x0F0F0F0F)) for v in raw]  # all rows' low nibbles first (fewer live vectors)
        s_lo = [_dot_chunks(b, low, a, 64 * p) for a in acts]
        high = [b.and_(b.lshr(v, _c(4)), _c(0x0F0F0F0F)) for v in raw]
        s_hi = [_dot_chunks(b, high, a, 64 * p + 32) for a in acts]
        for t, a in enumerate(acts):
            i_sum = b.add(b.mul(s_lo[t], scales[2 * p]), b.mul(s_hi[t], scales[2 * p + 1]))
            tot_i[t] = i_sum if tot_i[t] is None else b.add(tot_i[t], i_sum)
            tot_m[t] = dot_i16(b, _c(0) if tot_m[t] is None else tot_m[t], b.bitcast(min_pairs[p], vec(I16, 16)),
                               b.bitcast(a.bsum_pair(4 * p, 2), vec(I16, 16)))
            if kind == "gemm" or p == 3:
                acc[t] = fmuladd(b, b.sitofp(tot_i[t], V8F32), d_wx[t], acc[t])
                accm[t] = fmuladd(b, b.sitofp(tot_m[t], V8F32), dmin_x[t], accm[t])
                tot_i[t] = tot_m[t] = None
    return {"acc": acc, "accm": accm}


def _q6_k_codes(b, w_rows):
    """Transposed Q6_K codes 0..63: (value offset of the 32 values, 8 chunk vectors) per 32 values."""
    for half in range(2):
        qh = _load_rows(b, w_rows, 128 + 32 * half, 8)
        for g in (0, 2, 1, 3):  # ql[64 * half + 32 * k] is read by g = k and k + 2: one slab live at a time
            if g < 2:
                ql = _load_rows(b, w_rows, 64 * half + 32 * g, 8)
            out = []
            for c in range(8):
                low = ql[c]
                low = b.and_(low, _c(0x0F0F0F0F)) if g < 2 else b.and_(b.lshr(low, _c(4)), _c(0x0F0F0F0F))
                hb = b.and_(b.lshr(qh[c], _c(2 * g)), _c(0x03030303)) if g else b.and_(qh[c], _c(0x03030303))
                out.append(b.or_(low, b.shl(hb, _c(4))))
            yield 128 * half + 32 * g, out


def _q6_k_block(b, w_rows, acts, kind, accs):
    """One Q6_K block of the TILED path (exact block total)."""
    d = _halves_to_f32(b, _load_rows(b, w_rows, 194, 4)[3], 16)  # f16 d at byte 208: high half of word 206
    sw = _load_rows(b, w_rows, 192, 4)  # scales 4k..4k+3 in vector k
    scales = [_byte(b, sw[k // 4], k % 4, signed=True) for k in range(16)]
    pairs = [_i16_pair(b, scales[2 * k], scales[2 * k + 1]) for k in range(8)]
    # 32 * sum_k scale_k * bsums_k (pair sums of groups 2m, 2m + 1 in ``corr[t][m]``)
    corr = [[b.shl(dot_i16(b, _c(0), b.bitcast(pairs[m], vec(I16, 16)), b.bitcast(a.bsum_pair(2 * m), vec(I16, 16))),
                   _c(5)) for m in range(8)] for a in acts]
    s1 = [None] * len(acts)
    for offset, codes in _q6_k_codes(b, w_rows):
        g = offset // 16
        for t, a in enumerate(acts):
            for half in range(2):
                part = b.mul(_dot_chunks(b, codes[4 * half:4 * half + 4], a, offset + 16 * half), scales[g + half])
                s1[t] = part if s1[t] is None else b.add(s1[t], part)
    acc = list(accs["acc"])
    for t, a in enumerate(acts):
        total = s1[t]
        for m in range(8):
            total = b.sub(total, corr[t][m])
        r = b.fmul(b.sitofp(total, V8F32), d)
        acc[t] = fmuladd(b, r, a.d, acc[t])
    return {"acc": acc}


IQ4_XS_BYTES = TYPES[T.IQ4_XS].type_size
_IQ4_TABLES = {"IQ4_NL": KVALUES_IQ4NL, "IQ4_XS": KVALUES_IQ4NL, "MXFP4": KVALUES_MXFP4}


def _nibble_chunks(b, qs: list, table=None) -> list:
    """8 transposed chunk vectors of 32 values packed as nibbles: qs[k] holds bytes 4k..4k+3 of
    each row; chunk c < 4 is their low nibbles (values 4c..4c+3), chunk c >= 4 the high ones
    (values 16 + 4(c - 4)..). With ``table`` (16 values), each nibble n becomes table[n] + 128
    (vpshufb), the unsigned codes vpdpbusd takes."""
    out = []
    mask = _c(0x0F0F0F0F, qs[0])
    for c in range(8):
        nib = b.and_(qs[c % 4], mask) if c < 4 else b.and_(b.lshr(qs[c % 4], _c(4, qs[0])), mask)
        if table is not None:
            values = [v + 128 for v in table]
            if nib.type.count == ROWS:
                nib = b.bitcast(lookup16(b, values, b.bitcast(nib, V32I8)), V8I32)
            else:  # 16 lanes: the two 256-bit halves (vpshufb ymm)
                halves = [b.bitcast(lookup16(b, values, b.bitcast(shuffle(b, nib, range(h, h + ROWS)), V32I8)), V8I32)
                          for h in (0, ROWS)]
                nib = concat(b, *halves)
        out.append(nib)
    return out


def _iq4_xs_block(b, w_rows, acts, kind, accs):
    """One IQ4_XS block of the TILED path (ggml-cpu/tiled): S = sum_j (ls_j - 32) * I_j over its 8
    sub-blocks of 32 values (I_j exact: codes table value + 128 by vpdpbusd, from -128 * the
    sub-block's activation sum), r = float(S) * d_w, acc = fma(r, d_x, acc)."""
    head = _load_rows(b, w_rows, 0, 4)                              # d | scales_h, scales_l[4]
    d = _halves_to_f32(b, head[0], 0)
    sh, sl = b.lshr(head[0], _c(16)), head[1]
    totals = [None] * len(acts)
    for j in range(8):
        ls = b.or_(b.and_(b.lshr(sl, _c(8 * (j // 2) + 4 * (j % 2))), _c(0xF)),
                   b.shl(b.and_(b.lshr(sh, _c(2 * j)), _c(3)), _c(4)))
        scale = b.sub(ls, _c(32))
        codes = _nibble_chunks(b, _load_rows(b, w_rows, TYPES[T.IQ4_XS].offset("qs") + 16 * j, 4), KVALUES_IQ4NL)
        for t, a in enumerate(acts):
            pair = b.sext(shuffle(b, a.bsums, [2 * j, 2 * j + 1]), vec(I32, 2))
            start = splat(b, b.mul(b.add(b.extract_element(pair, ir.Constant(I32, 0)),
                                         b.extract_element(pair, ir.Constant(I32, 1))), ir.Constant(I32, -128)), ROWS)
            part = b.mul(_dot_chunks(b, codes, a, 32 * j, start), scale)
            totals[t] = part if totals[t] is None else b.add(totals[t], part)
    acc = list(accs["acc"])
    for t, a in enumerate(acts):
        acc[t] = fmuladd(b, b.fmul(b.sitofp(totals[t], V8F32), d), a.d, acc[t])
    return {"acc": acc}


# GEMV rows tiles of 32-value blocks: type -> (block bytes, offset that makes the codes unsigned)
Q0_ROWS = {"Q8_0": (TYPES[T.Q8_0].type_size, 128), "Q5_0": (TYPES[T.Q5_0].type_size, 16),
           "Q4_0": (TYPES[T.Q4_0].type_size, 8), "IQ4_NL": (TYPES[T.IQ4_NL].type_size, 128),
           "MXFP4": (TYPES[T.MXFP4].type_size, 128)}
_SPREAD = 0x02040810  # t * _SPREAD puts bit i of a 4-bit t at bit 8 * i + 4 (no carries)


def q0_words(b, name, w_rows) -> list:
    """The transposed 4-byte words of one 32-value Q8_0 / Q5_0 / Q4_0 / IQ4_NL / MXFP4 block of 8
    weight rows (i8* each, at the block) that q0_codes reads: <8 x i32> vectors, lane r = row r."""
    if name == "Q8_0":                                              # f16 d | q0 q1, then q[2..33]
        return [_load_rows(b, w_rows, 0, 4)[0], *_load_rows(b, w_rows, 2, 8)]
    if name in ("IQ4_NL", "MXFP4", "Q4_0"):  # f16 d | u8 qs[16] (MXFP4: u8 e | qs[16]); value j: nibble of qs[j % 16]
        return [_load_rows(b, w_rows, 0, 4)[0], *_load_rows(b, w_rows, TYPES[T[name]].offset("qs"), 4)]
    # Q5_0: f16 d | u32 qh | u8 qs[16]; value j: low nibble of qs[j] (j < 16) or high of qs[j - 16]
    return [*_load_rows(b, w_rows, 0, 4)[:2], *_load_rows(b, w_rows, 6, 4)]  # bytes 0..7, 6..21 (not past the block)


def q0_codes(b, name, words):
    """The unsigned codes and the scale of a 32-value block from its q0_words (8 or 16 lanes):
    8 chunk vectors (chunk c = values 4c..4c+3, q + offset, or for IQ4_NL / MXFP4 table value +
    128) and d_w (the f16 d, or MXFP4's e8m0 scale halved)."""
    head = words[0]
    if name == "Q8_0":
        codes = [b.xor(v, _c(0x80808080 - (1 << 32), v)) for v in words[1:]]
    elif name in ("IQ4_NL", "MXFP4", "Q4_0"):
        codes = _nibble_chunks(b, words[1:], _IQ4_TABLES.get(name))
        if name == "MXFP4":
            return codes, e8m0_half(b, b.trunc(head, vec(I8, head.type.count)))
    else:
        qh = b.or_(b.lshr(head, _c(16, head)), b.shl(words[1], _c(16, head)))  # bytes 2..5
        codes = [b.or_(nib, b.and_(b.mul(b.and_(b.lshr(qh, _c(4 * c, qh)), _c(0xF, qh)), _c(_SPREAD, qh)),
                                   _c(0x10101010, qh)))
                 for c, nib in enumerate(_nibble_chunks(b, words[2:]))]
    return codes, _halves_to_f32(b, head, 0)


def _q0_rows_block(b, name, w_rows, rows, blk, accs, x16):
    """One 32-value Q8_0 / Q5_0 / Q4_0 / IQ4_NL / MXFP4 block of the GEMV path: per output the exact integer block total
    I (lanes = weight rows), then acc = fma(I, d_w * d_x, acc) (the structure of llama.cpp's
    repacked q4_0 gemv; for IQ4_NL / MXFP4 that of ggml_gemv_iq4_nl_8x8_q8_0 / _mxfp4_8x8_, with
    d_w the f16 d or the e8m0 scale halved). Codes are made unsigned (q0_codes) for vpdpbusd;
    xa gives, per activation row and block, -offset * (sum of the block's activation quants)
    (int32), which starts each total."""
    codes, d = q0_codes(b, name, q0_words(b, name, w_rows))
    acc = list(accs["acc"])
    acts = [_Q0Act(b, xq, x16, blk) for xq in rows["xq"]]
    totals = [splat(b, load(b, xa, b.mul(blk, ir.Constant(I64, 4)), I32), ROWS) for xa in rows["xa"]]  # -offset * sum
    for c, v in enumerate(codes):   # activation rows interleaved: nt independent vpdpbusd chains
        totals = [dot_u8_s8(b, total, b.bitcast(v, V32I8), b.bitcast(act.quad(4 * c), V32I8))
                  for total, act in zip(totals, acts)]
    for t, (total, xd) in enumerate(zip(totals, rows["xd"])):
        d_x = splat(b, load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32), ROWS)
        acc[t] = fmuladd(b, b.sitofp(total, V8F32), b.fmul(d, d_x), acc[t])
    return {"acc": acc}


class _Q0Act(_Act):
    """Activation row of a 32-value block (Q8_0 quants): only quad() is used."""

    def __init__(self, b, xq, x16, blk):
        self.b, self.xq, self.x16 = b, xq, x16
        self.x_at = b.mul(blk, ir.Constant(I64, 32))


def build_rows_tile(module: ir.Module, ggml_type_name: str, kind: str, nt: int, name: str,
                    x16: bool) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)`` as kernels_cpu.matmul.build_tile does, for 8 weight rows x ``nt``
    activation rows of Q4_K (kind "gemv" / "gemm"), Q6_K or IQ4_XS ("tiled"), or Q8_0 / Q5_0 / Q4_0 / IQ4_NL / MXFP4 ("gemv";
    xa: int32 -offset * the sum of each block's activation quants, see Q0_ROWS)."""
    if ggml_type_name in Q0_ROWS:
        assert kind == "gemv", "Q8_0 / Q5_0 rows tiles compute the GEMV structure"

        def q0_body(b, rows, blk, accs):
            at = b.mul(blk, ir.Constant(I64, Q0_ROWS[ggml_type_name][0]))
            return _q0_rows_block(b, ggml_type_name, [b.gep(p, [at]) for p in rows["w"]], rows, blk, accs, x16)

        def q0_finish(b, new):
            return {(r, t): b.extract_element(new["acc"][t], ir.Constant(I32, r)) for t in range(nt) for r in range(ROWS)}

        return tile_function(module, name, ROWS, nt, {"acc": [ir.Constant(V8F32, [0.0] * ROWS)] * nt},
                             q0_body, q0_finish, Q0_ROWS[ggml_type_name][0])
    block_bytes, emit = {"Q4_K": (Q4_K_BYTES, _q4_k_block), "Q6_K": (Q6_K_BYTES, _q6_k_block),
                         "IQ4_XS": (IQ4_XS_BYTES, _iq4_xs_block)}[ggml_type_name]
    return k_rows_tile(module, name, nt, block_bytes, emit, kind, x16, with_min=ggml_type_name == "Q4_K")


def k_rows_tile(module: ir.Module, name: str, nt: int, block_bytes: int, emit, kind: str, x16: bool,
                with_min: bool) -> ir.Function:
    """The 8-row tile of a 256-value block type: ``emit(b, w_rows, acts, kind, accs)`` adds one block
    of the 8 weight rows (i8* each) with the ``nt`` activation rows (_Act) to accs {"acc"[, "accm"]}
    (<8 x float> per activation row, lane r: weight row r); the output is acc (- accm ``with_min``)."""
    names = ["acc", "accm"] if with_min else ["acc"]

    def body(b, rows, blk, accs):
        at = b.mul(blk, ir.Constant(I64, block_bytes))
        w_rows = [b.gep(p, [at]) for p in rows["w"]]
        acts = [_Act(b, *xr, x16, blk) for xr in zip(rows["xq"], rows["xd"], rows["xa"])]
        return emit(b, w_rows, acts, kind, accs)

    def finish(b, new):
        values = {}
        for t in range(nt):
            value = b.fsub(new["acc"][t], new["accm"][t]) if with_min else new["acc"][t]
            values.update({(r, t): b.extract_element(value, ir.Constant(I32, r)) for r in range(ROWS)})
        return values

    return tile_function(module, name, ROWS, nt, {k: [ir.Constant(V8F32, [0.0] * ROWS)] * nt for k in names},
                         body, finish, block_bytes)
