"""The K/V row arithmetic of attention, per KV pool type: a K row times a query, a V row times a
probability added to lane accumulators, and one token's row stored in the pool's type.

Pool types: f16 (uint16 bits), f32, q8_0 (uint8 rows of head_dim / 32 blocks: an f16 scale
and 32 int8, ggml's block_q8_0). kernels_cpu.attention walks the cells a query sees and calls
these through numba overloads typed by the pool, so a new KV type is one more branch in each
(:func:`prep_query`, ``_kdot``, ``_vacc``, :func:`store_row`). The lane orders and roundings
are ggml's CPU backend's (kernels_cpu.attention's module docstring): f16 rows take vector IR
(vcvtph2ps, vmulps, vaddps; no reassociation) in tinyBLAS's 16 lanes or ggml_vec_dot_f16's 64.
"""
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from kernels_cpu.f16 import f16_to_f32, f32_to_f16
from kernels_cpu.fmath import hsum16
from kernels_cpu.quantize_act import _q8_0_row
from kernels_cpu.simd import BYTE_PTR, F32, I8, I32, I64, hsum_f32, load, madd_pairs, splat, vec

TINY_LANES = 16   # tinyBLAS<16, __m512>: KN
VEC_STEP = 64     # GGML_F16_STEP on AVX-512 (4 x 16 lanes)
_QK8_0, _Q8_0_BYTES = 32, 34  # q8_0 KV: blocks of 32 values, f16 scale + 32 int8

# Products of two f16 values are exact in float32, so ggml's fused multiply-adds of f16 data
# equal the plain multiply-then-add used below (which also vectorizes without FMA hardware).


def _emit_dot_f16(builder, kp, qp, n_blocks, n_acc):
    """float32 dot of the f16 row at i8* kp and the float32 row at i8* qp over n_blocks (i64)
    blocks of 16 * n_acc elements, in ggml's lane order (see _dot_f16_lanes)."""
    v16 = vec(F32, 16)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(v16, [0.0] * 16)) for _ in range(n_acc)]
    with cgutils.for_range(builder, n_blocks) as loop:
        first = builder.mul(loop.index, ir.Constant(I64, 16 * n_acc))
        for a in range(n_acc):
            e = builder.add(first, ir.Constant(I64, 16 * a))
            kv = builder.fpext(load(builder, kp, builder.mul(e, ir.Constant(I64, 2)), vec(ir.HalfType(), 16)), v16)
            qv = load(builder, qp, builder.mul(e, ir.Constant(I64, 4)), v16)
            builder.store(builder.fadd(builder.load(accs[a]), builder.fmul(kv, qv)), accs[a])
    v = [builder.load(a) for a in accs]
    if n_acc == 4:
        v = [builder.fadd(builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]))]
    return hsum_f32(builder, v[0])


def _lanes_literal(lanes):
    return isinstance(lanes, types.IntegerLiteral) and lanes.literal_value in (16, 64)


@intrinsic
def _dot_f16_lanes(typingctx, k, q, n, lanes):
    """float32 dot product of k (uint16 f16 bits, 1-D contiguous) and q (float32, 1-D
    contiguous) over their first n elements (a multiple of ``lanes``), in ggml's lane order:
    ``lanes`` (literal 16 or 64) / 16 vector accumulators of 16 float32 lanes take elements
    in order, block by block; 64 lanes are combined (a0 + a2) + (a1 + a3); the 16 lanes are
    reduced by halves (_mm512_reduce_add_ps). Emitted as LLVM vector IR (vcvtph2ps, vmulps,
    vaddps; no reassociation)."""
    if not (_lanes_literal(lanes) and _is_vector(k, types.uint16) and _is_vector(q, types.float32)):
        return None
    n_acc = lanes.literal_value // 16
    sig = types.float32(k, q, n, lanes)

    def codegen(context, builder, signature, args):
        kp, qp, n, _ = _vector_args(context, builder, signature, args)
        n = context.cast(builder, n, signature.args[2], types.int64)
        return _emit_dot_f16(builder, kp, qp, builder.sdiv(n, ir.Constant(I64, 16 * n_acc)), n_acc)

    return sig, codegen


@intrinsic
def _dot_f16_cells(typingctx, blk, base, q, n, s0, s1, kq, j0, lanes):
    """kq[j0 + s - s0] = _dot_f16_lanes(blk[s, base:base + n], q, n, lanes) for the slots
    s0 <= s < s1 of one KV block ``blk`` (uint16[bs, row elements], C-contiguous): the cells of
    a block in one loop, so that their dot products overlap (as separate calls they did not)."""
    if not (_lanes_literal(lanes) and isinstance(blk, types.Array) and blk.ndim == 2 and blk.layout == "C"
            and blk.dtype == types.uint16 and _is_vector(q, types.float32) and _is_vector(kq, types.float32)):
        return None
    n_acc = lanes.literal_value // 16
    sig = types.void(blk, base, q, n, s0, s1, kq, j0, lanes)

    def codegen(context, builder, signature, args):
        ab = context.make_array(signature.args[0])(context, builder, args[0])
        row_bytes = cgutils.unpack_tuple(builder, ab.strides)[0]
        bp = builder.bitcast(ab.data, BYTE_PTR)
        _, base, qp, n, s0, s1, kqp, j0, _ = _vector_args(context, builder, signature, args)
        i64 = lambda v, i: context.cast(builder, v, signature.args[i], types.int64)  # noqa: E731
        base, n, s0, s1, j0 = i64(base, 1), i64(n, 3), i64(s0, 4), i64(s1, 5), i64(j0, 7)
        n_blocks = builder.sdiv(n, ir.Constant(I64, 16 * n_acc))
        with cgutils.for_range(builder, builder.sub(s1, s0)) as loop:
            s = builder.add(s0, loop.index)
            kp = builder.gep(bp, [builder.add(builder.mul(s, row_bytes), builder.mul(base, ir.Constant(I64, 2)))])
            value = _emit_dot_f16(builder, kp, qp, n_blocks, n_acc)
            at = builder.mul(builder.add(j0, loop.index), ir.Constant(I64, 4))
            builder.store(value, builder.bitcast(builder.gep(kqp, [at]), F32.as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _mad_f16_cells(typingctx, acc, blk, base, probs, s0, s1, j0, n):
    """acc[(j0 + s - s0) % lanes, d] += V[s, d] * f16(probs[j0 + s - s0]) for d < n (a multiple of
    16) and the slots s0 <= s < s1 of one KV block ``blk`` (uint16[bs, row elements]; V[s] =
    blk[s, base:base + n]); acc float32[lanes, >= n] C-contiguous, lanes its first dimension
    (a power of two: 16 or 64), j0 >= 0.
    The product of two f16 values is exact in float32: one rounding, in the add (as _vacc)."""
    if not (isinstance(acc, types.Array) and acc.ndim == 2 and acc.layout == "C" and acc.dtype == types.float32
            and isinstance(blk, types.Array) and blk.ndim == 2 and blk.layout == "C" and blk.dtype == types.uint16
            and _is_vector(probs, types.float32)):
        return None
    sig = types.void(acc, blk, base, probs, s0, s1, j0, n)

    def codegen(context, builder, signature, args):
        aa = context.make_array(signature.args[0])(context, builder, args[0])
        ab = context.make_array(signature.args[1])(context, builder, args[1])
        lane_mask = builder.sub(cgutils.unpack_tuple(builder, aa.shape)[0], ir.Constant(I64, 1))  # 16 or 64 lanes
        acc_row = cgutils.unpack_tuple(builder, aa.strides)[0]
        row_bytes = cgutils.unpack_tuple(builder, ab.strides)[0]
        ap, bp = builder.bitcast(aa.data, BYTE_PTR), builder.bitcast(ab.data, BYTE_PTR)
        _, _, base, pp, s0, s1, j0, n = _vector_args(context, builder, signature, args)
        i64 = lambda v, i: context.cast(builder, v, signature.args[i], types.int64)  # noqa: E731
        base, s0, s1, j0, n = i64(base, 2), i64(s0, 4), i64(s1, 5), i64(j0, 6), i64(n, 7)
        v16 = vec(F32, 16)
        n16 = builder.sdiv(n, ir.Constant(I64, 16))
        with cgutils.for_range(builder, builder.sub(s1, s0)) as loop:
            j = builder.add(j0, loop.index)
            p = load(builder, pp, builder.mul(j, ir.Constant(I64, 4)), F32)
            p16 = splat(builder, builder.fpext(builder.fptrunc(p, ir.HalfType()), F32), 16)
            vrow = builder.gep(bp, [builder.add(builder.mul(builder.add(s0, loop.index), row_bytes),
                                                builder.mul(base, ir.Constant(I64, 2)))])
            arow = builder.gep(ap, [builder.mul(builder.and_(j, lane_mask), acc_row)])
            with cgutils.for_range(builder, n16) as inner:
                e = builder.mul(inner.index, ir.Constant(I64, 16))
                v = builder.fpext(load(builder, vrow, builder.mul(e, ir.Constant(I64, 2)), vec(ir.HalfType(), 16)), v16)
                a = builder.bitcast(builder.gep(arow, [builder.mul(e, ir.Constant(I64, 4))]), v16.as_pointer())
                builder.store(builder.fadd(builder.load(a, align=4), builder.fmul(v, p16)), a, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _vector_args(context, builder, signature, args):
    """i8* data pointers of the array arguments of an intrinsic (other arguments as given)."""
    out = []
    for ty, value in zip(signature.args, args):
        if isinstance(ty, types.Array):
            out.append(builder.bitcast(context.make_array(ty)(context, builder, value).data, BYTE_PTR))
        else:
            out.append(value)
    return out


def _is_vector(a, dtype):
    return isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dtype


@intrinsic
def _dot_q8_0_row(typingctx, row, qs, qd, nb):
    """q8_0 K row . Q8_0 query: row uint8[nb * 34] (blocks of f16 scale + 32 int8), qs
    int8[nb * 32] and qd float32[nb] the query's quants and scales. Per block the exact int32
    dot of the quants (any summation order gives the same integer), converted to float32 and
    multiplied by (row scale * query scale); block results summed in order (ggml's
    ggml_vec_dot_q8_0_q8_0 arithmetic, blocks in plain order). LLVM vector IR: sign extension
    and pmaddwd-style pair products, no reassociation of floats."""
    if not (_is_vector(row, types.uint8) and _is_vector(qs, types.int8) and _is_vector(qd, types.float32)):
        return None
    sig = types.float32(row, qs, qd, nb)

    def codegen(context, builder, signature, args):
        rp, qp, dp, n = _vector_args(context, builder, signature, args)
        n = context.cast(builder, n, signature.args[3], types.int64)
        total = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
        i16x32 = vec(ir.IntType(16), _QK8_0)
        with cgutils.for_range(builder, n) as loop:
            b = loop.index
            o = builder.mul(b, ir.Constant(I64, _Q8_0_BYTES))
            dk = builder.fpext(load(builder, rp, o, ir.HalfType()), F32)
            kv = builder.sext(load(builder, rp, builder.add(o, ir.Constant(I64, 2)), vec(I8, _QK8_0)), i16x32)
            qv = builder.sext(load(builder, qp, builder.mul(b, ir.Constant(I64, _QK8_0)), vec(I8, _QK8_0)), i16x32)
            v = madd_pairs(builder, kv, qv)                          # <16 x i32>
            width = 16
            while width > 1:
                width //= 2
                v = builder.add(builder.shuffle_vector(v, v, ir.Constant(vec(I32, width), list(range(width)))),
                                builder.shuffle_vector(v, v, ir.Constant(vec(I32, width), list(range(width, 2 * width)))))
            isum = builder.sitofp(builder.extract_element(v, ir.Constant(I32, 0)), F32)
            dq = load(builder, dp, builder.mul(b, ir.Constant(I64, 4)), F32)
            builder.store(builder.fadd(builder.load(total), builder.fmul(isum, builder.fmul(dk, dq))), total)
        return builder.load(total)

    return sig, codegen


@intrinsic
def _mad_q8_0_row(typingctx, acc, row, p, nb):
    """acc[i] += (q_i * d_b) * p over a q8_0 V row: acc float32[nb * 32], row uint8[nb * 34]
    (blocks of f16 scale d_b + 32 int8 q_i), p float32; a multiply, a multiply and an add per
    element as in plain code (no fusion). LLVM vector IR."""
    if not (_is_vector(acc, types.float32) and _is_vector(row, types.uint8) and p == types.float32):
        return None
    sig = types.void(acc, row, p, nb)

    def codegen(context, builder, signature, args):
        ap, rp, pv, n = _vector_args(context, builder, signature, args)
        n = context.cast(builder, n, signature.args[3], types.int64)
        f32x32 = vec(F32, _QK8_0)
        ps = splat(builder, pv, _QK8_0)
        with cgutils.for_range(builder, n) as loop:
            b = loop.index
            o = builder.mul(b, ir.Constant(I64, _Q8_0_BYTES))
            dv = splat(builder, builder.fpext(load(builder, rp, o, ir.HalfType()), F32), _QK8_0)
            vals = builder.sitofp(load(builder, rp, builder.add(o, ir.Constant(I64, 2)), vec(I8, _QK8_0)), f32x32)
            a = builder.bitcast(builder.gep(ap, [builder.mul(b, ir.Constant(I64, 4 * _QK8_0))]), f32x32.as_pointer())
            builder.store(builder.fadd(builder.load(a, align=1), builder.fmul(builder.fmul(vals, dv), ps)), a, align=1)
        return context.get_dummy_value()

    return sig, codegen


def _kdot(row, qv, hd, tiny):
    """K row . query (typed by the pool: see the overload below)."""


@overload(_kdot, jit_options={"cache": True})
def _kdot_impl(row, qv, hd, tiny):
    """f16 K (uint16 bits): tinyBLAS (16 lanes) or ggml_vec_dot_f16 order (64 lanes, then the
    hd % 64 leftover products added in float64), qv the query rounded to f16. f32 K: 16 float32
    lanes in order. q8_0 K (uint8 rows of hd/32 blocks: f16 scale, 32 int8): per block the exact
    integer dot with the query's Q8_0 quants times both scales, summed in order (qv = (quants
    int8[hd], scales float32[hd/32]); _dot_q8_0_row)."""
    if row.dtype == types.uint16:
        def f16(row, qv, hd, tiny):
            if tiny:
                return _dot_f16_lanes(row, qv, hd, 16)
            nb = hd - hd % VEC_STEP
            s = _dot_f16_lanes(row, qv, nb, 64)
            if nb < hd:
                d = np.float64(s)
                for e in range(nb, hd):
                    d += np.float64(f16_to_f32(row[e]) * qv[e])
                s = np.float32(d)
            return s
        return f16
    if row.dtype == types.float32:
        def f32(row, qv, hd, tiny):
            lanes = np.zeros(TINY_LANES, np.float32)
            for e in range(hd):
                lanes[e % TINY_LANES] += row[e] * qv[e]
            return hsum16(lanes, 0)
        return f32
    if row.dtype == types.uint8:
        def q8_0(row, qv, hd, tiny):
            return _dot_q8_0_row(row, qv[0], qv[1], hd // _QK8_0)
        return q8_0
    return None


def prep_query(q, t, h, pool):
    """The query row in the form _kdot takes for ``pool``'s K type."""


@overload(prep_query, jit_options={"cache": True})
def prep_query_impl(q, t, h, pool):
    """f16 K: q rounded to f16 (ggml converts src1 to the F16 vec_dot_type); f32 K: q as is;
    q8_0 K: q quantized to Q8_0 (quantize_row_q8_0: quants as float32, then the block scales)."""
    if pool.dtype == types.uint16:
        def f16(q, t, h, pool):
            hd = q.shape[2]
            out = np.empty(hd, np.float32)
            for i in range(hd):
                out[i] = f16_to_f32(f32_to_f16(q[t, h, i]))
            return out
        return f16
    if pool.dtype == types.float32:
        return lambda q, t, h, pool: q[t, h].copy()
    if pool.dtype == types.uint8:
        def q8_0(q, t, h, pool):
            hd = q.shape[2]
            qs = np.empty(hd, np.int8)
            d = np.empty(hd // _QK8_0, np.float32)
            _q8_0_row(q[t, h], qs, d, d, False)
            return qs, d
        return q8_0
    return None


def _vacc(acc, row, p, hd_v):
    """acc[d] += V row value d * p (typed by the pool: see the overload below)."""


@overload(_vacc, jit_options={"cache": True})
def _vacc_impl(acc, row, p, hd_v):
    """f16 V: p rounded to f16 first (ggml converts kq to V's F16 vec_dot_type); f32 V: p as is;
    q8_0 V: the dequantized value (int8 * f16 scale) times p."""
    if row.dtype == types.uint16:
        def f16(acc, row, p, hd_v):
            p16 = f16_to_f32(f32_to_f16(p))
            for d in range(hd_v):
                acc[d] += f16_to_f32(row[d]) * p16
        return f16
    if row.dtype == types.float32:
        def f32(acc, row, p, hd_v):
            for d in range(hd_v):
                acc[d] += row[d] * p
        return f32
    if row.dtype == types.uint8:
        def q8_0(acc, row, p, hd_v):
            _mad_q8_0_row(acc, row, p, hd_v // _QK8_0)
        return q8_0
    return None


def kq_block(qv, blk, base, n, hd, s0, s1, tiny, kq, j0):
    """kq[j0 + s - s0] = K row of slot s of block blk . q, for s0 <= s < s1."""


@overload(kq_block, jit_options={"cache": True})
def kq_block_impl(qv, blk, base, n, hd, s0, s1, tiny, kq, j0):
    """f16 K: the cells of the block in one vector loop (_dot_f16_cells) when hd is a whole
    number of ggml blocks (else, and for other K types, _kdot per cell)."""
    if blk.dtype == types.uint16:
        def f16(qv, blk, base, n, hd, s0, s1, tiny, kq, j0):
            if tiny:
                _dot_f16_cells(blk, base, qv, hd, s0, s1, kq, j0, 16)
            elif hd % VEC_STEP == 0:
                _dot_f16_cells(blk, base, qv, hd, s0, s1, kq, j0, 64)
            else:
                for s in range(s0, s1):
                    kq[j0 + s - s0] = _kdot(blk[s, base:base + n], qv, hd, tiny)
        return f16

    def other(qv, blk, base, n, hd, s0, s1, tiny, kq, j0):
        for s in range(s0, s1):
            kq[j0 + s - s0] = _kdot(blk[s, base:base + n], qv, hd, tiny)
    return other


def kqv_block(acc, blk, base, n, hd_v, probs, s0, s1, j0):
    """acc[j % lanes] += V row of cell j * probs[j] for the cells j = j0 + s - s0 of block blk."""


@overload(kqv_block, jit_options={"cache": True})
def kqv_block_impl(acc, blk, base, n, hd_v, probs, s0, s1, j0):
    """f16 V with hd_v a multiple of 16: one vector loop over the block's cells
    (_mad_f16_cells); otherwise, and for other V types, _vacc per cell."""
    if blk.dtype == types.uint16:
        def f16(acc, blk, base, n, hd_v, probs, s0, s1, j0):
            if hd_v % 16 == 0:
                _mad_f16_cells(acc, blk, base, probs, s0, s1, j0, hd_v)
            else:
                for s in range(s0, s1):
                    j = j0 + s - s0
                    _vacc(acc[j % acc.shape[0]], blk[s, base:base + n], probs[j], hd_v)
        return f16

    def other(acc, blk, base, n, hd_v, probs, s0, s1, j0):
        for s in range(s0, s1):
            j = j0 + s - s0
            _vacc(acc[j % acc.shape[0]], blk[s, base:base + n], probs[j], hd_v)
    return other


def store_row(dst, src):
    """Write one token's K or V (src f32[n_head * head_dim]) into a pool row (typed by the pool)."""


@overload(store_row, jit_options={"cache": True})
def store_row_impl(dst, src):
    """f16: round to nearest even (ggml_cpy f32 -> f16); f32: copy; q8_0: each head's values
    quantized by quantize_row_q8_0 into hd/32 blocks of (f16 scale, 32 int8)."""
    if dst.dtype == types.uint16:
        def f16(dst, src):
            for j in range(src.shape[0]):
                dst[j] = f32_to_f16(src[j])
        return f16
    if dst.dtype == types.float32:
        def f32(dst, src):
            dst[:] = src
        return f32
    if dst.dtype == types.uint8:
        def q8_0(dst, src):
            n = src.shape[0]
            nb = n // _QK8_0
            qs = np.empty(n, np.int16)
            d = np.empty(nb, np.float32)
            _q8_0_row(src, qs, d, d, False)
            for b in range(nb):
                o = b * _Q8_0_BYTES
                bits = f32_to_f16(d[b])
                dst[o] = np.uint8(bits & np.uint16(0xFF))
                dst[o + 1] = np.uint8(bits >> np.uint16(8))
                for e in range(_QK8_0):
                    dst[o + 2 + e] = np.uint8(qs[b * _QK8_0 + e] & 0xFF)  # two's complement byte
        return q8_0
    return None


