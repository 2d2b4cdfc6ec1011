"""Causal attention over an f16 KV cache, computed exactly as llama.cpp's CPU backend does it
without flash attention (llm_graph_context::build_attn_mha, flash_attn = false):

    kq   = ggml_mul_mat(k, q)                  K (f16 cache) x Q rounded to f16, f32 results
    kq   = ggml_soft_max_ext(kq, mask, scale)  scale, -inf mask, ggml_v_expf, float64 sum
    kqv  = ggml_mul_mat(v, kq)                 V^T (f16 cache) x probabilities rounded to f16

Both products are f16 dot products accumulated in float32 lanes with FMA, and the lane layout
decides the rounding. ggml's x86 AVX-512 build (the one the goldens come from) uses:

* ``T >= 2`` query rows: llamafile's tinyBLAS (sgemm.cpp, tinyBLAS<16, __m512, ...>): one
  16-lane accumulator per output, lane j takes elements j, j+16, ... in order, then
  _mm512_reduce_add_ps (:func:`kernels_cpu.fmath.hsum16`). Needs the dot length to be a
  multiple of 16 and the output rows a multiple of 4, else ggml falls back to:
* ``T == 1`` (decode): ggml_vec_dot_f16 (vec.cpp): four 16-lane accumulators over blocks of 64
  elements, combined (acc0+acc2) + (acc1+acc3), reduced by hsum16; the n % 64 leftover
  products are added one by one in float64.

llama.cpp pads the KV view to a multiple of 256 cells; padding, future and out-of-window cells
are masked to -inf, get probability exactly 0 and add exact zeros to every lane, so the
kernels here visit only the cells a query can see and keep llama.cpp's lane of each cell
(its index modulo 16 or 64). KV cells are positions: cell j of a sequence's slot holds
position j (as llama.cpp's cache for one sequence, without the wrap-around of its
sliding-window cache, which is full-size for n_ctx <= the window). Several sequences decoded
together each read their own slot; their rows choose the kernel lanes as one batch of T rows.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from kernels_cpu.f16 import f16_to_f32, f32_to_f16
from kernels_cpu.fmath import hsum16, v_expf
from kernels_cpu.quantize_act import _q8_0_row
from kernels_cpu.simd import BYTE_PTR, F32, I8, I32, I64, hsum_f32, load, madd_pairs, splat, vec

_TINY_LANES = 16   # tinyBLAS<16, __m512>: KN
_VEC_STEP = 64     # GGML_F16_STEP on AVX-512 (4 x 16 lanes)
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
            nb = hd - hd % _VEC_STEP
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
            lanes = np.zeros(_TINY_LANES, np.float32)
            for e in range(hd):
                lanes[e % _TINY_LANES] += row[e] * qv[e]
            return hsum16(lanes, 0)
        return f32
    if row.dtype == types.uint8:
        def q8_0(row, qv, hd, tiny):
            return _dot_q8_0_row(row, qv[0], qv[1], hd // _QK8_0)
        return q8_0
    return None


def _prep_q(q, t, h, pool):
    """The query row in the form _kdot takes for ``pool``'s K type."""


@overload(_prep_q, jit_options={"cache": True})
def _prep_q_impl(q, t, h, pool):
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


@njit(cache=True, nogil=True)
def _kq_row(qv, pool, table, base, n, hd, start, end, tiny, kq):
    """kq[j] = K[j] . q for cells start..end-1 (see _kdot for the lane orders). K rows of n
    pool elements through the block table: pool[table[j // bs], j % bs, base:base+n]
    (walked block by block, no division per cell)."""
    bs = pool.shape[1]
    for b in range(start // bs, (end + bs - 1) // bs):
        first = b * bs
        j0 = max(start, first)
        _kq_block(qv, pool[table[b]], base, n, hd, j0 - first, min(end, first + bs) - first, tiny, kq, j0)


def _kq_block(qv, blk, base, n, hd, s0, s1, tiny, kq, j0):
    """kq[j0 + s - s0] = K row of slot s of block blk . q, for s0 <= s < s1."""


@overload(_kq_block, jit_options={"cache": True})
def _kq_block_impl(qv, blk, base, n, hd, s0, s1, tiny, kq, j0):
    """f16 K: the cells of the block in one vector loop (_dot_f16_cells) when hd is a whole
    number of ggml blocks (else, and for other K types, _kdot per cell)."""
    if blk.dtype == types.uint16:
        def f16(qv, blk, base, n, hd, s0, s1, tiny, kq, j0):
            if tiny:
                _dot_f16_cells(blk, base, qv, hd, s0, s1, kq, j0, 16)
            elif hd % _VEC_STEP == 0:
                _dot_f16_cells(blk, base, qv, hd, s0, s1, kq, j0, 64)
            else:
                for s in range(s0, s1):
                    kq[j0 + s - s0] = _kdot(blk[s, base:base + n], qv, hd, tiny)
        return f16

    def other(qv, blk, base, n, hd, s0, s1, tiny, kq, j0):
        for s in range(s0, s1):
            kq[j0 + s - s0] = _kdot(blk[s, base:base + n], qv, hd, tiny)
    return other


@njit(cache=True, nogil=True)
def _softmax_row(kq, start, end, scale, block, probs):
    """probs[j] for cells start..end-1 = ggml_compute_forward_soft_max_f32 of the row kq with
    every other cell masked to -inf: x = kq * scale; m = max x; e = ggml_v_expf(x - m); each
    16-cell block (cells 16b..16b+15; masked cells count 0) summed with _mm512_reduce_add_ps,
    block sums accumulated in float64 in order; probs = e * float32(1.0 / sum).
    block: float32[16] scratch. Other entries of probs are left unchanged."""
    mx = np.float32(-np.inf)
    for j in range(start, end):
        x = kq[j] * scale
        probs[j] = x
        mx = max(mx, x)
    for j in range(start, end):
        probs[j] = v_expf(probs[j] - mx)
    total = 0.0
    for b in range(start - start % 16, end, 16):
        for i in range(16):
            j = b + i
            block[i] = probs[j] if start <= j < end else np.float32(0.0)
        total += np.float64(hsum16(block, 0))
    inv = np.float32(1.0 / total)
    for j in range(start, end):
        probs[j] *= inv


@njit(cache=True, nogil=True)
def _kqv_row(probs, pool, table, base, n, hd_v, start, end, tiny, acc, out):
    """out[d] = sum over cells j of V[j, d] * probs[j] (f16-rounded for f16 V), cell j in lane
    j % 16 (tinyBLAS) or j % 64 (ggml_vec_dot_f16, lanes then combined as in _kq_row), lanes
    reduced by hsum16. V rows of n pool elements through the block table as in _kq_row.
    acc: float32[64, hd_v] scratch."""
    lanes = _TINY_LANES if tiny else _VEC_STEP
    acc[:lanes, :] = 0.0
    bs = pool.shape[1]
    for b in range(start // bs, (end + bs - 1) // bs):
        first = b * bs
        j0 = max(start, first)
        _kqv_block(acc[:lanes], pool[table[b]], base, n, hd_v, probs, j0 - first, min(end, first + bs) - first, j0)
    if not tiny:
        for j in range(16):
            for d in range(hd_v):
                acc[j, d] = (acc[j, d] + acc[j + 32, d]) + (acc[j + 16, d] + acc[j + 48, d])
    for d in range(hd_v):
        out[d] = _hsum16_column(acc, d)


def _kqv_block(acc, blk, base, n, hd_v, probs, s0, s1, j0):
    """acc[j % lanes] += V row of cell j * probs[j] for the cells j = j0 + s - s0 of block blk."""


@overload(_kqv_block, jit_options={"cache": True})
def _kqv_block_impl(acc, blk, base, n, hd_v, probs, s0, s1, j0):
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


@njit(cache=True, inline="always")
def _hsum16_column(acc, d):
    """hsum16 of the column acc[0:16, d] (_mm512_reduce_add_ps order)."""
    a0 = acc[0, d] + acc[8, d]
    a1 = acc[1, d] + acc[9, d]
    a2 = acc[2, d] + acc[10, d]
    a3 = acc[3, d] + acc[11, d]
    a4 = acc[4, d] + acc[12, d]
    a5 = acc[5, d] + acc[13, d]
    a6 = acc[6, d] + acc[14, d]
    a7 = acc[7, d] + acc[15, d]
    return ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


@njit(cache=True, inline="always")
def _visible(p, window):
    """First cell a query at position p sees (llama.cpp LLAMA_SWA_TYPE_STANDARD: p - j < window)."""
    if window > 0 and p - window + 1 > 0:
        return p - window + 1
    return 0


@njit(cache=True, nogil=True)
def _paths(T, hd, hd_v, batch_invariant=False):
    """(tinyBLAS for KQ, tinyBLAS for KQV): llamafile_sgemm takes n >= 2 rows when the dot length
    is a multiple of 16 and the output rows (cells for KQ, hd_v for KQV) a multiple of 4.
    ``batch_invariant``: every row as a batch of one (ggml_vec_dot_f16 orders)."""
    multi = T >= 2 and not batch_invariant
    return multi and hd % _TINY_LANES == 0, multi and hd_v % 4 == 0


@njit(cache=True, nogil=True)
def _attention_rows(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, out, first, step,
                    tiny_kq, tiny_kqv):
    """attention_f16 for the (row, head) pairs first, first + step, ... (pair th = row th // H,
    head th % H), with the lane orders of _paths."""
    T, H, hd = q.shape
    n_blocks, bs, H_kv = k_pool.shape[0], k_pool.shape[1], k_pool.shape[2]
    hd_v = out.shape[2]
    nk, nv = k_pool.shape[3], v_pool.shape[3]  # pool elements per head row
    group = H // H_kv
    kflat = k_pool.reshape(n_blocks, bs, -1)
    vflat = v_pool.reshape(n_blocks, bs, -1)
    block = np.empty(16, np.float32)
    acc = np.empty((_VEC_STEP, hd_v), np.float32)
    for th in range(first, T * H, step):
        t = th // H
        h = th % H
        kh = h // group
        table = tables[seq_ids[t]]
        p = positions[t]
        start = _visible(p, window)
        row = np.empty(p + 1, np.float32)
        _kq_row(_prep_q(q, t, h, k_pool), kflat, table, kh * nk, nk, hd, start, p + 1, tiny_kq, row)
        _softmax_row(row, start, p + 1, scale, block, row)
        _kqv_row(row, vflat, table, kh * nv, nv, hd_v, start, p + 1, tiny_kqv, acc, out[t, h])


@njit(parallel=True, cache=True, nogil=True)
def _attention_par(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, out, tiny_kq, tiny_kqv):
    # interleaved pairs: numba splits a prange into contiguous ranges, and causal rows grow
    n_chunks = min(q.shape[0] * q.shape[1], 64)
    for c in prange(n_chunks):
        _attention_rows(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, out, c, n_chunks,
                        tiny_kq, tiny_kqv)


# Below this many multiply-adds (rows x heads x visible cells x head_dim) attention runs on the
# calling thread: waking the worker threads costs more (a decode step at a short context).
PARALLEL_MIN_MACS = 1 << 18


def attention_f16(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, out, batch_invariant=False):
    """Multi-head causal attention with GQA over a paged f16 KV cache, bit-exact with
    llama.cpp's non-flash CPU path.

    Shapes: q f32[T, H, hd] (already multiplied by any query scale the model applies, e.g.
    Gemma's f_attention_scale); k_pool uint16[n_blocks, bs, H_kv, hd] and v_pool
    uint16[n_blocks, bs, H_kv, hd_v] (f16 bits, holding this chunk's K/V already); tables
    int32[S, max_blocks]: position j of sequence s is in block tables[s, j // bs], slot
    j % bs (a contiguous cache is one block of n_ctx per sequence); seq_ids and positions
    int32[T] (row t is the query of sequence seq_ids[t] at positions[t]); out f32[T, H, hd_v].
    ``scale`` (float32) multiplies the scores before the softmax (ggml_soft_max_ext's scale;
    1.0 for Gemma). Query head h reads KV head h // (H / H_kv). A query at position p sees
    the cells j <= p of its own sequence, and with ``window`` > 0 only j > p - window (blocks
    wholly before that may be holes). The T rows pick the kernel lanes as llama.cpp does for a
    batch of T tokens (module docstring), or with ``batch_invariant`` each as a batch of one
    (so a row's result does not depend on the other rows). Callers check the tables; a wrong
    block id is an out-of-bounds read.
    """
    T, H, hd = q.shape
    if k_pool.ndim != 4 or v_pool.shape[:3] != k_pool.shape[:3] or H % k_pool.shape[2] or out.shape[:2] != (T, H) \
            or seq_ids.shape != (T,) or positions.shape != (T,):
        raise ValueError(f"attention_f16: q {q.shape}, pools {k_pool.shape} / {v_pool.shape}, out {out.shape} "
                         "do not fit")
    tiny_kq, tiny_kqv = _paths(T, hd, out.shape[2], batch_invariant)
    cells = int(positions.max()) + 1 if window <= 0 else min(int(positions.max()) + 1, window)
    if T * H * cells * hd >= PARALLEL_MIN_MACS:
        _attention_par(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, out, tiny_kq, tiny_kqv)
    else:
        _attention_rows(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, out, 0, 1, tiny_kq, tiny_kqv)


def _store_row(dst, src):
    """Write one token's K or V (src f32[n_head * head_dim]) into a pool row (typed by the pool)."""


@overload(_store_row, jit_options={"cache": True})
def _store_row_impl(dst, src):
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


@njit(cache=True, nogil=True)
def store_kv(src, pool, tables, seq_ids, positions):
    """Write this chunk's K or V rows into the paged cache in the pool's type (f16: round to
    nearest even as ggml_cpy f32 -> f16; f32: as is; q8_0: quantize_row_q8_0 per 32 values):
    row t goes to position positions[t] of sequence seq_ids[t], i.e. block
    tables[seq, pos // bs], slot pos % bs.

    Shapes: src f32[T, H_kv * head_dim]; pool uint16 (f16) or float32 [n_blocks, bs, H_kv,
    head_dim], or uint8 [n_blocks, bs, H_kv, head_dim / 32 * 34] (q8_0); tables
    int32[S, max_blocks], seq_ids and positions int32[T] (checked by the caller).
    """
    n_blocks, bs = pool.shape[0], pool.shape[1]
    flat = pool.reshape(n_blocks, bs, -1)
    for t in range(src.shape[0]):
        p = positions[t]
        _store_row(flat[tables[seq_ids[t], p // bs], p % bs], src[t])


@njit(parallel=True, cache=True, nogil=True)
def attention_scores(q, k_cache, positions, window, scale, kq_out, probs_out):
    """The KQ product and the softmax of :func:`attention_f16` (llama.cpp's ``kq-L`` and
    ``kq_soft_max-L`` tensors, here [T, H, n] instead of ggml's [H, T, n_kv]); a testing and
    inspection aid.

    Shapes: q f32[T, H, hd]; k_cache uint16[n_ctx, H_kv, hd]; kq_out, probs_out f32[T, H, n]
    with n > max(positions). Cells a query cannot see get kq_out = 0 (llama.cpp computes a
    value there that the mask then discards) and probs_out = 0.
    """
    T, H, hd = q.shape
    group = H // k_cache.shape[1]
    kflat = k_cache.reshape(1, k_cache.shape[0], -1)       # one block of n_ctx cells
    table = np.zeros(1, np.int32)
    tiny_kq = _paths(T, hd, 4)[0]
    for th in prange(T * H):
        t = th // H
        h = th % H
        p = positions[t]
        start = _visible(p, window)
        kq_out[t, h, :] = 0.0
        probs_out[t, h, :] = 0.0
        _kq_row(_prep_q(q, t, h, k_cache), kflat, table, (h // group) * hd, hd, hd, start, p + 1, tiny_kq, kq_out[t, h])
        _softmax_row(kq_out[t, h], start, p + 1, scale, np.empty(16, np.float32), probs_out[t, h])
