"""Q4_0 / Q5_0 / Q8_0 (vec_dot) matmul tiles for CPUs with AVX2 and without AVX-512 VNNI and for
arm64 with DotProd, and Q4_1 / Q5_1 tiles for every CPU with AVX2 or DotProd: 8-bit products through ``vpmaddubsw`` (``vpdpbusd``
ymm where AVX-512 VNNI or AVX-VNNI is there), one weight row per 256-bit vector.

They reproduce the generic tiles of path VEC_DOT (kernels_cpu.matmul_tiles) for these types,
whose float part is 8 lanes per output: lane j holds the integer sum of values 4j..4j+3 of the
32-value block, acc = fma(d_w * d_x, float(lane), acc) per block, result hsum_float_8. The
generic tile forms the lanes from int16 values (``vpmaddwd`` of widened weights and quants, then
a merge of lanes); here ``vpmaddubsw`` (u8 x s8 pair sums to int16) and ``vpmaddwd`` with ones
give the same exact integers already in ggml's 8-lane layout, and the float operations are the
same, so the results are bit-identical to the generic tiles'. The integer sequence is llama.cpp's
own AVX2 one (mul_sum_i8_pairs_float in ggml_vec_dot_q{4,5,8}_0_q8_0 and llamafile's
tinyBLAS_Q0_AVX).

``vpmaddubsw`` saturates its pair sums to int16, so the operands are kept where it is exact:

* Q8_0 (codes -128..127): llama.cpp's sign trick, |w| (u8, at most 128) times x * sign(w)
  (``vpsignb``; |x| <= 127), pair sums at most 2 * 128 * 127 = 32512.
* Q4_0 / Q5_0: the unsigned codes q (0..15, 0..31) times x, at most 2 * 31 * 127 = 7874, and the
  offset (8, 16) times the sum of x's 4 values subtracted, computed once per activation block.
* Q4_1 / Q5_1 (x Q8_1, ggml_vec_dot_q4_1_q8_1 / _q5_1_q8_1): the unsigned codes times x, no
  offset; the block minimum enters as llama.cpp's scalar chain sum = fma(m_w, s_x, sum) per
  output (s_x: the Q8_1 block's d * sum of its quants), added after hsum_float_8.

Activation quants must lie in [-127, 127], as quantize_row_q8_0 makes them (d = amax / 127; a
-128 would not be negated by ``vpsignb`` in the Q8_0 tile).

With AVX-512 VNNI, or AVX-VNNI (simd.HAS_AVX_VNNI: the VEX form ``{vex} vpdpbusd ymm``, from the
same LLVM intrinsic), the lanes come from one ``vpdpbusd`` (same exact integers, no int16 step),
as in ggml's mul_sum_us8_pairs_float under __AVX512VNNI__ / __AVXVNNI__. On
arm64 with DotProd (simd.HAS_DOTPROD) from two ``sdot`` (16 bytes each: lanes 0-3, 4-7), signed by
signed: Q8_0 needs no sign trick there, and every other code is at most 127. The tiles then are
llama.cpp's arm kernels' integer step (ggml_vec_dot_q8_0_q8_0 in arch/arm/quants.c: vdotq_s32)
with edge's float structure, so the answers stay those of every other CPU.

numba's on-disk cache keys matmul's kernels on matmul_kernels.py only: after editing this module,
clear kernels_cpu/__pycache__/matmul_kernels.*.nbi / .nbc.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as T
from llvmlite import ir

from kernels_cpu.ggml_types import TYPES
from kernels_cpu.simd import (F32, HAS_AVX_VNNI, HAS_DOTPROD, HAS_VNNI, I8, I16, I32, I64, bit_lanes, concat, dot_u8_s8,
                              fmuladd, load, load_half, madd_u8_s8_256, sdot_256, shuffle, sign_i8_256, splat,
                              sum_pairs_i16_256, tile_function, vec)

V32I8, V8I32, V8F32 = vec(I8, 32), vec(I32, 8), vec(F32, 8)
AVX2_TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1")
_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 0, "Q4_1": 0, "Q5_1": 0}  # subtracted from the unsigned codes


def _bytes(value: int):
    return ir.Constant(V32I8, [value] * 32)


def _sum4(b, u8, s8, acc=None):
    """<8 x i32>: lane j = acc[j] (default 0) + sum of u8[k] * s8[k] for k = 4j..4j+3 (one vpdpbusd
    into acc with AVX-512 VNNI or AVX-VNNI, else vpmaddubsw, then vpmaddwd with ones and an add; the
    pair sums must not saturate, see the module docstring; on arm64 two sdot, signed x signed: u8
    must then be at most 127, as the codes are)."""
    if HAS_VNNI or HAS_AVX_VNNI:
        return dot_u8_s8(b, ir.Constant(V8I32, [0] * 8) if acc is None else acc, u8, s8)
    if HAS_DOTPROD:
        lanes = sdot_256(b, None, u8, s8)
    else:
        lanes = sum_pairs_i16_256(b, madd_u8_s8_256(b, u8, s8))
    return lanes if acc is None else b.add(lanes, acc)


def _codes(b, name: str, p):
    """<32 x i8> codes of the block at i8* p: Q8_0 its signed quants, Q4_0 / Q5_0 the unsigned
    q (value + offset), low nibbles first."""
    at = TYPES[T[name]].offset("qs")
    if name == "Q8_0":
        return load(b, p, at, V32I8)
    qs = load(b, p, at, vec(I8, 16))
    low = concat(b, b.and_(qs, ir.Constant(vec(I8, 16), [0x0F] * 16)), b.lshr(qs, ir.Constant(vec(I8, 16), [4] * 16)))
    if name in ("Q4_0", "Q4_1"):
        return low
    qh = bit_lanes(b, load(b, p, TYPES[T[name]].offset("qh"), I32))  # bit 4 of value j = bit j of qh
    return b.or_(low, b.select(qh, _bytes(16), _bytes(0)))


def _quants(b, xq, offset, x16: bool):
    """<32 x i8> activation quants at value ``offset`` of a row (int16 quants narrowed)."""
    if x16:
        return b.trunc(load(b, xq, b.mul(offset, ir.Constant(I64, 2)), vec(I16, 32)), V32I8)
    return load(b, xq, offset, V32I8)


def _block(b, name: str, rows, blk, accs, x16: bool):
    """One 32-value block of every (weight row r, activation row t): accumulator r * nt + t."""
    block_bytes, offset = TYPES[T[name]].type_size, _OFFSET[name]
    at_x = b.mul(blk, ir.Constant(I64, 32))
    xs, dxs, starts = [], [], []
    for xq, xd in zip(rows["xq"], rows["xd"]):
        xs.append(_quants(b, xq, at_x, x16))
        dxs.append(load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32))
        if offset:  # -offset * (sum of x's values 4j..4j+3)
            starts.append(b.sub(ir.Constant(V8I32, [0] * 8), _sum4(b, _bytes(offset), xs[-1])))
    acc, sums = list(accs["acc"]), list(accs.get("sum", ()))
    nt = len(xs)
    for r, w in enumerate(rows["w"]):
        p = b.gep(w, [b.mul(blk, ir.Constant(I64, block_bytes))])
        codes = _codes(b, name, p)
        dw = load_half(b, p, 0)
        if sums:  # Q4_1 / Q5_1: + m_w * s_x, a scalar fma chain per output
            m = load_half(b, p, TYPES[T[name]].offset("m"))
            for t, xa in enumerate(rows["xa"]):
                sums[r * nt + t] = fmuladd(b, m, load(b, xa, b.mul(blk, ir.Constant(I64, 4)), F32), sums[r * nt + t])
        if name == "Q8_0" and not HAS_DOTPROD:
            magnitude = sign_i8_256(b, codes, codes)  # |w|: -128 -> 0x80, 128 as unsigned
        for t in range(nt):
            if name == "Q8_0" and HAS_DOTPROD:        # sdot multiplies signed by signed
                lanes = _sum4(b, codes, xs[t])
            elif name == "Q8_0":
                lanes = _sum4(b, magnitude, sign_i8_256(b, xs[t], codes))
            else:
                lanes = _sum4(b, codes, xs[t], starts[t] if offset else None)
            scale = splat(b, b.fmul(dxs[t], dw), 8)
            acc[r * nt + t] = fmuladd(b, scale, b.sitofp(lanes, V8F32), acc[r * nt + t])
    return {"acc": acc, "sum": sums} if sums else {"acc": acc}


def build_avx2_tile(module: ir.Module, ggml_type_name: str, nr: int, nt: int, name: str, x16: bool) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)`` as kernels_cpu.matmul_tiles.build_tile does for path VEC_DOT, for ``nr``
    weight rows x ``nt`` activation rows of Q4_0, Q5_0 or Q8_0; activation quants int8 (or int16
    when ``x16``)."""
    assert ggml_type_name in AVX2_TYPES, ggml_type_name

    def body(b, rows, blk, accs):
        return _block(b, ggml_type_name, rows, blk, accs, x16)

    def finish(b, new):
        """hsum_float_8 = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then + the m * s sum."""
        out = {}
        for i, v in enumerate(new["acc"]):
            for step in (4, 2, 1):  # lane j + lane j ^ step
                v = b.fadd(v, shuffle(b, v, [lane ^ step for lane in range(8)]))
            out[divmod(i, nt)] = b.extract_element(v, ir.Constant(I32, 0))
            if "sum" in new:
                out[divmod(i, nt)] = b.fadd(out[divmod(i, nt)], new["sum"][i])
        return out

    accs = {"acc": [ir.Constant(V8F32, [0.0] * 8)] * (nr * nt)}
    if ggml_type_name in ("Q4_1", "Q5_1"):
        accs["sum"] = [ir.Constant(F32, 0.0)] * (nr * nt)
    return tile_function(module, name, nr, nt, accs, body, finish, TYPES[T[ggml_type_name]].type_size)
