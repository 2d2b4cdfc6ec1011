"""Q5_0 / Q8_0 and Q6_K (vec_dot) matmul tiles with one weight row per vector, for CPUs
with AVX-512 VNNI.

Both reproduce kernels whose float part is 8 lanes per output (kernels_cpu.matmul, path VEC_DOT):
lane j holds the integer sum of values 4j..4j+3 of every 32-value segment of a block, the block
updates acc = fma(d_w * d_x, float(lane), acc) and the result is hsum_float_8. Here the integer
lanes come straight out of VNNI instructions in that layout, and the float operations are
llama.cpp's, so the results are bit-identical to the generic tiles (and llama.cpp).

* Q5_0 / Q8_0 x Q8_0 (ggml_vec_dot_q{5,8}_0_q8_0, llamafile tinyBLAS_Q0_AVX): the weights are
  made unsigned (q + 16, q + 128 as u8) and ``vpdpbusd`` multiplies them with the activation
  quants, starting from -offset * (sum of the activations' 4 values) per lane, computed once
  per activation block: lane = sum (q + offset) * x - offset * sum x, exact. Two weight rows
  share a 512-bit vector (lanes 0-7 and 8-15), so the float updates run on 16 lanes.
* Q6_K x Q8_K (ggml_vec_dot_q6_K_q8_K): codes 0..63 of 64 values per 512-bit vector,
  ``vpmaddubsw`` with the quants (pair sums, at most 2 * 63 * 127: no saturation), then
  ``vpdpwssd`` with the 16-value group scales (int32 lane j: scale * values 4j..4j+3 of the
  vector's two 32-value segments; the two 256-bit halves are added at the end of the block),
  minus 32 * (scale * bsums) per 32-value segment as in ggml.

numba's on-disk cache keys matmul's kernels on matmul_kernels.py only: after editing this module,
clear kernels_cpu/__pycache__/matmul_kernels.*.nbi / .nbc.
"""
from __future__ import annotations

from llvmlite import ir

from gguf import GGMLQuantizationType as T

from kernels_cpu.ggml_types import TYPES
from kernels_cpu.simd import (F32, I8, I16, I32, I64, bit_lanes, concat, dot_i16, dot_u8_s8, fmuladd, load,
                              load_half, madd_pairs, madd_u8_s8, shuffle, splat, tile_function, vec)

V8I32, V16I32, V8F32, V16F32 = vec(I32, 8), vec(I32, 16), vec(F32, 8), vec(F32, 16)
V32I8, V64I8, V32I16 = vec(I8, 32), vec(I8, 64), vec(I16, 32)
Q5_0, Q8_0, Q6_K = TYPES[T.Q5_0], TYPES[T.Q8_0], TYPES[T.Q6_K]
Q0_FORMATS = {  # type -> (block bytes, offset added to the codes)
    "Q5_0": (Q5_0.type_size, 16), "Q8_0": (Q8_0.type_size, 128),
}
Q6_K_BYTES = Q6_K.type_size


def _bytes(value: int, n: int):
    return ir.Constant(vec(I8, n), [value] * n)


def _quants(b, xq, offset, n: int, x16: bool):
    """<n x i8> activation quants at value ``offset`` of a row (int16 quants narrowed)."""
    if x16:
        return b.trunc(load(b, xq, b.mul(offset, ir.Constant(I64, 2)), vec(I16, n)), vec(I8, n))
    return load(b, xq, offset, vec(I8, n))


def _q0_codes(b, name: str, p):
    """<32 x i8> unsigned codes q + offset of the block at i8* p."""
    if name == "Q8_0":
        return b.xor(load(b, p, Q8_0.offset("qs"), V32I8), _bytes(0x80, 32))
    qs = load(b, p, Q5_0.offset("qs"), vec(I8, 16))  # Q5_0: low 4 bits, then bit 4 of value j = bit j of qh
    low = concat(b, b.and_(qs, _bytes(0x0F, 16)), b.lshr(qs, _bytes(4, 16)))
    return b.or_(low, b.select(bit_lanes(b, load(b, p, Q5_0.offset("qh"), I32)), _bytes(16, 32), _bytes(0, 32)))


def _gather(b, values: list, lanes: list):
    """<len(lanes) x float> with lane i = values[lanes[i]] (scalars)."""
    v = ir.Constant(vec(F32, len(values)), ir.Undefined)
    for i, x in enumerate(values):
        v = b.insert_element(v, x, ir.Constant(I32, i))
    return shuffle(b, v, lanes)


def _q0_block(b, name, rows, blk, accs, x16):
    """One 32-value block of every (row pair k, activation row t): accumulator k * nt + t, lanes
    0-7 for the pair's first row, 8-15 for the second."""
    block_bytes, offset = Q0_FORMATS[name]
    at_w = b.mul(blk, ir.Constant(I64, block_bytes))
    at_x = b.mul(blk, ir.Constant(I64, 32))
    zero = ir.Constant(V16I32, [0] * 16)
    xs, dxs, starts = [], [], []
    for xq, xd in zip(rows["xq"], rows["xd"]):
        x = _quants(b, xq, at_x, 32, x16)
        xs.append(concat(b, x, x))
        dxs.append(load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32))
        starts.append(b.sub(zero, dot_u8_s8(b, zero, _bytes(offset, 64), xs[-1])))  # -offset * sum of 4 quants
    acc = list(accs["acc"])
    nt = len(xs)
    for k in range(len(rows["w"]) // 2):
        p, q = (b.gep(w, [at_w]) for w in rows["w"][2 * k:2 * k + 2])
        codes = concat(b, _q0_codes(b, name, p), _q0_codes(b, name, q))
        dw = _gather(b, [load_half(b, p, 0), load_half(b, q, 0)], [0] * 8 + [1] * 8)
        for t in range(nt):
            lanes = dot_u8_s8(b, starts[t], codes, xs[t])
            acc[k * nt + t] = fmuladd(b, b.fmul(splat(b, dxs[t], 16), dw), b.sitofp(lanes, V16F32), acc[k * nt + t])
    return {"acc": acc}


_SHIFT_A = ir.Constant(V32I16, [4] * 16 + [2] * 16)  # bits 0-1 / 2-3 of qh to bits 4-5
_SHIFT_B = ir.Constant(V32I16, [0] * 16 + [2] * 16)  # bits 4-5 / 6-7 of qh to bits 4-5


def _q6_k_codes(b, p):
    """(value offset, <64 x i8> codes 0..63) of the Q6_K block at i8* p, 64 values at a time."""
    for half in range(2):
        ql = load(b, p, Q6_K.offset("ql") + 64 * half, V64I8)
        qh = load(b, p, Q6_K.offset("qh") + 32 * half, V32I8)
        qh = b.bitcast(concat(b, qh, qh), V32I16)  # segments g = 0, 1 (then 2, 3) of this half
        for k, (low, high) in enumerate(((b.and_(ql, _bytes(0x0F, 64)), b.shl(qh, _SHIFT_A)),
                                         (b.and_(b.lshr(ql, _bytes(4, 64)), _bytes(0x0F, 64)), b.lshr(qh, _SHIFT_B)))):
            high = b.and_(b.bitcast(high, V64I8), _bytes(0x30, 64))
            yield 128 * half + 64 * k, b.or_(low, high)


def _reload(b):
    """Compiler barrier: memory is read again after it (loads are not reused across it)."""
    b.asm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", [], side_effect=True)


def _q6_k_row(b, p, acts, at_x, x16):
    """Integer lanes <8 x i32> of one Q6_K block at i8* p with each activation row of ``acts``."""
    if len(acts) > 1:  # the activations are memory operands again (not 4 * nt vectors kept, spilled)
        _reload(b)
    scales = b.sext(load(b, p, Q6_K.offset("scales"), vec(I8, 16)), vec(I16, 16))
    sums = [ir.Constant(V16I32, [0] * 16)] * len(acts)
    for offset, codes in _q6_k_codes(b, p):
        group_scales = shuffle(b, scales, [offset // 16 + i // 8 for i in range(32)])
        for t, (xq, _, _) in enumerate(acts):
            pairs = madd_u8_s8(b, codes, _quants(b, xq, b.add(at_x, ir.Constant(I64, offset)), 64, x16))
            sums[t] = dot_i16(b, sums[t], pairs, group_scales)
    out = []
    for s, (_, _, bsums) in zip(sums, acts):
        corr = b.shl(madd_pairs(b, scales, bsums), ir.Constant(V8I32, [5] * 8))
        out.append(b.sub(b.add(shuffle(b, s, range(8)), shuffle(b, s, range(8, 16))), corr))
    return out


def _q6_k_block(b, name, rows, blk, accs, x16):
    """One Q6_K block of every (row pair, activation row), accumulators as in _q0_block."""
    at_x = b.mul(blk, ir.Constant(I64, 256))
    acts = [(xq, load(b, xd, b.mul(blk, ir.Constant(I64, 4)), F32),
             load(b, xa, b.mul(blk, ir.Constant(I64, 32)), vec(I16, 16)))
            for xq, xd, xa in zip(rows["xq"], rows["xd"], rows["xa"])]
    acc = list(accs["acc"])
    nt = len(acts)
    for k in range(len(rows["w"]) // 2):
        p, q = (b.gep(w, [b.mul(blk, ir.Constant(I64, Q6_K_BYTES))]) for w in rows["w"][2 * k:2 * k + 2])
        dw = _gather(b, [load_half(b, p, Q6_K.offset("d")), load_half(b, q, Q6_K.offset("d"))], [0] * 8 + [1] * 8)
        first, second = _q6_k_row(b, p, acts, at_x, x16), _q6_k_row(b, q, acts, at_x, x16)
        for t, (_, dx, _) in enumerate(acts):
            v = b.sitofp(concat(b, first[t], second[t]), V16F32)
            acc[k * nt + t] = fmuladd(b, b.fmul(splat(b, dx, 16), dw), v, acc[k * nt + t])
    return {"acc": acc}


def build_vnni_tile(module: ir.Module, ggml_type_name: str, nr: int, nt: int, name: str, x16: bool) -> ir.Function:
    """Define ``void name(w, w_stride, xq, xq_stride, xd, xd_stride, xa, xa_stride, out, out_stride,
    out_r_stride, nb)`` as kernels_cpu.matmul.build_tile does for path VEC_DOT, for ``nr`` weight
    rows x ``nt`` activation rows of Q5_0, Q8_0 or Q6_K; activation quants int8 (or int16
    when ``x16``)."""
    emit = _q6_k_block if ggml_type_name == "Q6_K" else _q0_block
    assert nr % 2 == 0, "VNNI tiles take weight rows in pairs"

    def body(b, rows, blk, accs):
        return emit(b, ggml_type_name, rows, blk, accs, x16)

    def finish(b, new):
        """hsum_float_8 = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) of both halves at once."""
        out = {}
        for i, v in enumerate(new["acc"]):
            for step in (4, 2, 1):  # lane j + lane j ^ step (within each 8-lane half)
                v = b.fadd(v, shuffle(b, v, [lane ^ step for lane in range(16)]))
            k, t = divmod(i, nt)
            for h in range(2):
                out[2 * k + h, t] = b.extract_element(v, ir.Constant(I32, 8 * h))
        return out

    zeros = [ir.Constant(V16F32, [0.0] * 16)] * (nr // 2 * nt)  # one accumulator per pair of weight rows
    block_bytes = Q6_K_BYTES if ggml_type_name == "Q6_K" else Q0_FORMATS[ggml_type_name][0]
    return tile_function(module, name, nr, nt, {"acc": zeros}, body, finish, block_bytes)
