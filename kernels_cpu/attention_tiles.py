"""Attention over an f16 KV pool for a tile of query rows at once: the path of
kernels_cpu.attention for prefill (many rows), with the same results bit for bit as its walk of
one (row, head) pair at a time, in both lane orders (module docstring of kernels_cpu.attention).

A tile is a run of consecutive positions of one sequence and one KV head with all of its query
heads (its GQA group). The K and V rows of the cells the tile sees are converted to float32
once, for all of its queries:

* KQ: K transposed (16 cells in the lanes of a vector). A score's accumulator k (its products
  k, k + lanes, ... in order; lanes = 16 for tinyBLAS, 64 for ggml_vec_dot_f16) is one vector
  over 16 cells; the 16 (64) accumulators are then added by _mm512_reduce_add_ps's tree (after
  (a0 + a2) + (a1 + a3) for 64 lanes) vector by vector, so that each of the 16 cells gets
  exactly the additions of its own dot product.
* softmax: kernels_cpu.attention._softmax_row in 16-cell vectors; the sums of 16 blocks are
  made together (a transposed _mm512_reduce_add_ps) and added to the float64 total in order.
* KQV: V rows ordered by lane (cell j % 16). llama.cpp's accumulator of lane j % lanes is a
  vector over 16 head dims, for several query heads of a row at once, kept in registers over
  the cells of the lane; the lanes are then added in llama.cpp's order.
"""
import math

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels_cpu import fmath as fm
from kernels_cpu.simd import BYTE_PTR, F32, HAS_AVX512, I32, I64, fma, hsum_f32, load, scalef, shuffle, splat, vec

V16 = vec(F32, 16)
_KQ_QUERIES = 4      # queries sharing each K vector in the KQ kernel


def _tree16(b, leaf, m=1, k=0):
    """The _mm512_reduce_add_ps tree over 16 values leaf(0..15) (lists of vectors, one per
    query): node(k, m) = node(k, 2m) + node(k + m, 2m), leaves at m = 16; depth first, so few
    partial sums are live at once."""
    if m == 16:
        return leaf(k)
    left = _tree16(b, leaf, 2 * m, k)
    right = _tree16(b, leaf, 2 * m, k + m)
    return [b.fadd(x, y) for x, y in zip(left, right)]


def _lane_leaf(b, lanes, lane):
    """leaf(m) of _tree16 for ``lanes`` accumulators given by lane(i) (16: lane m; 64: ggml's
    (a0 + a2) + (a1 + a3) of lanes m, m + 16, m + 32, m + 48)."""
    if lanes == 16:
        return lane

    def leaf(m):
        a0, a2 = lane(m), lane(m + 32)
        s02 = [b.fadd(x, y) for x, y in zip(a0, a2)]
        a1, a3 = lane(m + 16), lane(m + 48)
        return [b.fadd(x, b.fadd(y, z)) for x, y, z in zip(s02, a1, a3)]
    return leaf


def _function(module, name, args):
    """(function, builder at its entry) for a new internal void function of ``module``, or
(function, None) when ``module`` has it already."""
    fn = module.globals.get(name)
    if fn is not None:
        return fn, None
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), args), name)
    fn.linkage = "internal"
    return fn, ir.IRBuilder(fn.append_basic_block("entry"))


def _kq_group(module, hd, lanes, r):
    """void(kt, q, q_stride, out, out_stride): the scores of r queries (float32 rows of hd at
    q + i * q_stride bytes) against the 16 cells of a transposed K block kt (float32[hd, 16]),
    stored as one vector of 16 cells per query at out + i * out_stride bytes."""
    fn, b = _function(module, f"edge_attn_kq_{hd}_{lanes}_{r}", [BYTE_PTR, BYTE_PTR, I64, BYTE_PTR, I64])
    if b is None:
        return fn
    kt, qp, q_stride, outp, out_stride = fn.args
    rows = [b.gep(qp, [b.mul(ir.Constant(I64, i), q_stride)]) for i in range(r)]

    def chain(m, acc=None):
        # accumulator m of each query over the 16 cells: the products of elements m, m + lanes,
        # ... added in order to acc (None: from the first product). llama.cpp adds the first
        # product to +0: the same value, but +0 where the product is -0; a score can thus only
        # differ in the sign of a zero, which changes nothing in the softmax (x - max and exp).
        for d in range(m, hd, lanes):
            k = load(b, kt, d * 64, V16)
            qs = [splat(b, load(b, row, d * 4, F32), 16) for row in rows]
            acc = [b.fmul(q, k) for q in qs] if acc is None else [fma(b, q, k, a) for q, a in zip(qs, acc)]
        return acc

    if lanes == 64 and hd == 64:
        # one product per accumulator: a0 + a2 = a0 + q k is fma(q, k, a0) (q k is exact)
        def leaf(m):
            a02, a13 = chain(m + 32, chain(m)), chain(m + 48, chain(m + 16))
            return [b.fadd(x, y) for x, y in zip(a02, a13)]
    else:
        leaf = _lane_leaf(b, lanes, chain)
    for i, v in enumerate(_tree16(b, leaf)):
        b.store(v, b.bitcast(b.gep(outp, [b.mul(ir.Constant(I64, i), out_stride)]), V16.as_pointer()), align=4)
    b.ret_void()
    return fn


def _groups(builder, n, most, body):
    """body(first, count) for n items in ceil(n / most) even groups (count <= most), dispatched
    to code made for each count: body(first, c) is called with c a Python int 1..most."""
    one = ir.Constant(I64, 1)
    n_groups = builder.sdiv(builder.add(n, ir.Constant(I64, most - 1)), ir.Constant(I64, most))
    divisor = builder.select(builder.icmp_signed("<", n_groups, one), one, n_groups)
    size = builder.sdiv(builder.add(n, builder.sub(divisor, one)), divisor)
    with cgutils.for_range(builder, n_groups) as loop:
        first = builder.mul(loop.index, size)
        count = builder.sub(n, first)
        count = builder.select(builder.icmp_signed("<", count, size), count, size)
        done = builder.append_basic_block("groups.done")
        switch = builder.switch(count, done)
        for c in range(1, most + 1):
            block = builder.append_basic_block(f"groups.{c}")
            switch.add_case(ir.Constant(I64, c), block)
            builder.position_at_end(block)
            body(first, c)
            builder.branch(done)
        builder.position_at_end(done)


def _data(context, builder, ty, value):
    return builder.bitcast(context.make_array(ty)(context, builder, value).data, BYTE_PTR)


def _i64(context, builder, ty, value):
    return context.cast(builder, value, ty, types.int64)


def _flat(*arrays):
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays)


@intrinsic
def _kq_cells(typingctx, kt, b0, b1, qf, nq, kq, ld, hd, lanes):
    """kq[i * ld + c] = score of query i (qf[i * hd: (i + 1) * hd], f16 values as float32) and
    cell c of the transposed K kt (float32[blocks, hd, 16] flat: cell 16 b + s), for the
    cells of blocks b0 <= b < b1 and queries i < nq: the dot product in ``lanes`` accumulators
    (16: tinyBLAS, 64: ggml_vec_dot_f16; literal), then _mm512_reduce_add_ps. hd: literal, a
    multiple of ``lanes``. Arrays 1-D C float32."""
    if not (isinstance(hd, types.IntegerLiteral) and isinstance(lanes, types.IntegerLiteral) and _flat(kt, qf, kq)):
        return None
    hd_, lanes_ = hd.literal_value, lanes.literal_value
    sig = types.void(kt, b0, b1, qf, nq, kq, ld, hd, lanes)

    def codegen(context, builder, signature, args):
        a = signature.args
        ktp, qp, kqp = (_data(context, builder, a[i], args[i]) for i in (0, 3, 5))
        b0_, b1_, nq_, ld_ = (_i64(context, builder, a[i], args[i]) for i in (1, 2, 4, 6))
        q_stride = ir.Constant(I64, 4 * hd_)
        out_stride = builder.mul(ld_, ir.Constant(I64, 4))
        with cgutils.for_range_slice(builder, b0_, b1_, ir.Constant(I64, 1)) as (blk, _):
            ktb = builder.gep(ktp, [builder.mul(blk, ir.Constant(I64, 64 * hd_))])
            outb = builder.gep(kqp, [builder.mul(blk, ir.Constant(I64, 64))])

            def body(first, count):
                fn = _kq_group(builder.module, hd_, lanes_, count)
                builder.call(fn, [ktb, builder.gep(qp, [builder.mul(first, q_stride)]), q_stride,
                                  builder.gep(outb, [builder.mul(first, out_stride)]), out_stride])
            _groups(builder, nq_, _KQ_QUERIES, body)
        return context.get_dummy_value()

    return sig, codegen


def _transpose16(b, rows):
    """16 vectors of 16 lanes -> their transpose (vector i = lane i of every input): four rounds
    of interleaving vector i with vector i + 8 (a perfect shuffle of (vector, lane) bits)."""
    lo = [x for i in range(8) for x in (i, 16 + i)]
    hi = [x + 8 for x in lo]
    for _ in range(4):
        rows = [shuffle(b, rows[i // 2], lo if i % 2 == 0 else hi, rows[i // 2 + 8]) for i in range(16)]
    return rows


@intrinsic
def _transposed(typingctx, pool, slots, nblk, row, base, n, out):
    """out[b, d, s] = float32 of element d < n of the row of cell 16 b + s (out float32[nblk, n,
    16] flat), the row of cell c being pool[slots[c] * row + base: ... + n] (pool uint16 f16
    bits, slots int64; 1-D C arrays); n a multiple of 16."""
    if not (_flat(pool, slots, out) and pool.dtype == types.uint16):
        return None
    sig = types.void(pool, slots, nblk, row, base, n, out)
    i16x16 = vec(ir.IntType(16), 16)

    def codegen(context, builder, signature, args):
        a = signature.args
        pp, sp, outp = (_data(context, builder, a[i], args[i]) for i in (0, 1, 6))
        nblk_, row_, base_, n_ = (_i64(context, builder, a[i], args[i]) for i in (2, 3, 4, 5))
        two, c64 = ir.Constant(I64, 2), ir.Constant(I64, 64)
        with cgutils.for_range(builder, nblk_) as blk:
            cells = []
            for s in range(16):
                c = builder.add(builder.mul(blk.index, ir.Constant(I64, 16)), ir.Constant(I64, s))
                slot = load(builder, sp, builder.mul(c, ir.Constant(I64, 8)), I64)
                cells.append(builder.gep(pp, [builder.mul(builder.add(builder.mul(slot, row_), base_), two)]))
            out = builder.gep(outp, [builder.mul(blk.index, builder.mul(n_, c64))])
            with cgutils.for_range_slice(builder, ir.Constant(I64, 0), n_, ir.Constant(I64, 16)) as (d0, _):
                cols = _transpose16(builder, [load(builder, c, builder.mul(d0, two), i16x16) for c in cells])
                at = builder.gep(out, [builder.mul(d0, c64)])
                for i, col in enumerate(cols):
                    v = builder.fpext(builder.bitcast(col, vec(ir.HalfType(), 16)), V16)
                    builder.store(v, builder.bitcast(builder.gep(at, [ir.Constant(I64, 64 * i)]), V16.as_pointer()),
                                  align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _by_lane(typingctx, pool, slots, nblk, row, base, n, chunk, out):
    """The rows of the cells c < 16 nblk converted to float32 and laid out for _kqv_cells: in
    chunks of ``chunk`` elements (a multiple of 16 dividing n), chunk by chunk, and in a chunk
    the cells of one lane (c % 16) after each other: out[((d // chunk) * 16 nblk + (c % 16) *
    nblk + c // 16) * chunk + d % chunk] = element d < n of the row of cell c (its row
    pool[slots[c] * row + base: ... + n]; pool uint16 f16 bits, slots int64, out float32; 1-D C
    arrays)."""
    if not (_flat(pool, slots, out) and pool.dtype == types.uint16):
        return None
    sig = types.void(pool, slots, nblk, row, base, n, chunk, out)

    def codegen(context, builder, signature, args):
        a = signature.args
        pp, sp, outp = (_data(context, builder, a[i], args[i]) for i in (0, 1, 7))
        nblk_, row_, base_, n_, chunk_ = (_i64(context, builder, a[i], args[i]) for i in (2, 3, 4, 5, 6))
        two, four = ir.Constant(I64, 2), ir.Constant(I64, 4)
        cells = builder.mul(nblk_, ir.Constant(I64, 16))
        chunk_bytes = builder.mul(builder.mul(cells, chunk_), four)   # one chunk of every cell
        with cgutils.for_range(builder, cells) as cell:
            slot = load(builder, sp, builder.mul(cell.index, ir.Constant(I64, 8)), I64)
            src = builder.gep(pp, [builder.mul(builder.add(builder.mul(slot, row_), base_), two)])
            lane = builder.and_(cell.index, ir.Constant(I64, 15))
            at = builder.add(builder.mul(lane, nblk_), builder.ashr(cell.index, ir.Constant(I64, 4)))
            dst = builder.gep(outp, [builder.mul(builder.mul(at, chunk_), four)])
            with cgutils.for_range_slice(builder, ir.Constant(I64, 0), n_, ir.Constant(I64, 16)) as (d, _):
                v = builder.fpext(load(builder, src, builder.mul(d, two), vec(ir.HalfType(), 16)), V16)
                k = builder.sdiv(d, chunk_)
                o = builder.add(builder.mul(k, chunk_bytes), builder.mul(builder.sub(d, builder.mul(k, chunk_)), four))
                builder.store(v, builder.bitcast(builder.gep(dst, [o]), V16.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _f16_rounded(typingctx, src, s0, dst, d0, n):
    """dst[d0 + i] = src[s0 + i] rounded to f16 (as float32) for i < n, n a multiple of 16
    (ggml converts the query to F16 for an f16 K); float32 1-D C arrays."""
    if not (_flat(src, dst) and src.dtype == types.float32 and dst.dtype == types.float32):
        return None
    sig = types.void(src, s0, dst, d0, n)

    def codegen(context, builder, signature, args):
        a = signature.args
        sp, dp = _data(context, builder, a[0], args[0]), _data(context, builder, a[2], args[2])
        s0_, d0_, n_ = (_i64(context, builder, a[i], args[i]) for i in (1, 3, 4))
        four = ir.Constant(I64, 4)
        with cgutils.for_range_slice(builder, ir.Constant(I64, 0), n_, ir.Constant(I64, 16)) as (i, _):
            v = load(builder, sp, builder.mul(builder.add(s0_, i), four), V16)
            v = builder.fpext(builder.fptrunc(v, vec(ir.HalfType(), 16)), V16)
            builder.store(v, builder.bitcast(builder.gep(dp, [builder.mul(builder.add(d0_, i), four)]),
                                             V16.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


# ggml_v_expf (vec.h, AVX-512), as kernels_cpu.fmath.v_expf
def _v_expf(b, x, use_scalef=HAS_AVX512):
    """ggml_v_expf of the 16 lanes of x, each exactly as kernels_cpu.fmath.v_expf (the last
    scaling by vscalefps with ``use_scalef``, else in float64)."""
    def c(value):
        return ir.Constant(V16, [float(value)] * 16)
    z = fma(b, x, c(fm._EXP_LOG2E), c(fm._EXP_SHIFT))
    n = b.fsub(z, c(fm._EXP_SHIFT))
    neg = b.fneg(n)
    r = fma(b, neg, c(fm._EXP_LN2_LO), fma(b, neg, c(fm._EXP_LN2_HI), x))
    u = b.fmul(r, r)
    j = fma(b, fma(b, fma(b, c(fm._EXP_C5), r, c(fm._EXP_C4)), u, fma(b, c(fm._EXP_C3), r, c(fm._EXP_C2))), u,
            fma(b, c(fm._EXP_C1), r, c(fm._ONE)))
    lim = 192.0
    if use_scalef:
        # j * 2**n rounded once (_mm512_scalef_ps, as ggml)
        res = scalef(b, j, n)
    else:
        # the same as an exact float64 product rounded to float32
        clamped = b.select(b.fcmp_ordered(">", n, c(-lim)), n, c(-lim))
        clamped = b.select(b.fcmp_ordered("<", clamped, c(lim)), clamped, c(lim))
        i64x16 = vec(I64, 16)
        e = b.fptosi(clamped, i64x16)
        scale = b.bitcast(b.shl(b.add(e, ir.Constant(i64x16, [1023] * 16)), ir.Constant(i64x16, [52] * 16)),
                          vec(ir.DoubleType(), 16))
        res = b.fptrunc(b.fmul(b.fpext(j, vec(ir.DoubleType(), 16)), scale), V16)
    big = b.select(b.fcmp_ordered("<=", n, c(0.0)), c(0.0), c(math.inf))
    absn = b.select(b.fcmp_ordered("<", n, c(0.0)), neg, n)
    return b.select(b.fcmp_ordered(">", absn, c(lim)), big, res)


def _hsum16_each(b, vs):
    """16 vectors of 16 lanes -> one vector whose lane i is _mm512_reduce_add_ps of vs[i]: the
    same additions, done for all 16 at once by pairing vectors (a transposed reduction)."""
    width = 16                        # lanes per input in each vector
    while width > 1:
        half = width // 2
        n_in = 16 // width            # inputs per vector
        lo = [g * width + i for g in range(n_in) for i in range(half)]
        lo = lo + [16 + x for x in lo]
        hi = [x + half for x in lo]
        vs = [b.fadd(shuffle(b, vs[i], lo, vs[i + 1]), shuffle(b, vs[i], hi, vs[i + 1])) for i in range(0, len(vs), 2)]
        width = half
    return vs[0]


def _lane_mask(b, c, a, e):
    """<16 x i1>: a <= c + i < e for lanes i (c, a, e i64 with e - a < 2**31)."""
    iota = ir.Constant(vec(I32, 16), list(range(16)))
    lo = splat(b, b.trunc(b.sub(a, c), I32), 16)
    hi = splat(b, b.trunc(b.sub(e, c), I32), 16)
    return b.and_(b.icmp_signed(">=", iota, lo), b.icmp_signed("<", iota, hi))


def _softmax_fn(module):
    """void(row, a, e, scale, dst, nb): kernels_cpu.attention._softmax_row of the scores row[a:e]
    (float32 at i8* row; a multiple of 16 cells from cell 0 of the tile), the probabilities
    rounded to f16 (as KQV takes them) and stored by lane: probability of cell c at dst + (c %
    16) * nb + c // 16 (float32; nb >= e / 16 + 16). For the 16-cell blocks from a - a % 16 on:
    cells outside a..e-1 of those blocks get 0. The scores are overwritten; row must be
    readable up to 256 cells past e."""
    fn, b = _function(module, "edge_attn_softmax_f16", [BYTE_PTR, I64, I64, F32, BYTE_PTR, I64])
    if b is None:
        return fn
    row, a, e, scale, dst, nb = fn.args
    a0 = b.and_(a, ir.Constant(I64, -16))
    n_blk = b.sdiv(b.add(b.sub(e, a0), ir.Constant(I64, 15)), ir.Constant(I64, 16))
    c64 = ir.Constant(I64, 64)
    ninf = ir.Constant(V16, [-math.inf] * 16)
    zero = ir.Constant(V16, [0.0] * 16)

    def at(blk):
        return b.bitcast(b.gep(row, [b.add(b.mul(a0, ir.Constant(I64, 4)), b.mul(blk, c64))]), V16.as_pointer())

    def cell(blk):
        return b.add(a0, b.mul(blk, ir.Constant(I64, 16)))

    # x = kq * scale, its maximum over a..e-1 (in 4 running maxima: the order does not matter)
    def scaled(blk, m):
        x = b.fmul(b.load(at(blk), align=4), splat(b, scale, 16))
        b.store(x, at(blk), align=4)
        return b.select(b.and_(_lane_mask(b, cell(blk), a, e), b.fcmp_ordered(">", x, m)), x, m)

    mx = [cgutils.alloca_once_value(b, ninf) for _ in range(4)]
    n4 = b.sdiv(n_blk, ir.Constant(I64, 4))
    with cgutils.for_range(b, n4) as loop:
        for i, m in enumerate(mx):
            b.store(scaled(b.add(b.mul(loop.index, ir.Constant(I64, 4)), ir.Constant(I64, i)), b.load(m)), m)
    with cgutils.for_range_slice(b, b.mul(n4, ir.Constant(I64, 4)), n_blk, ir.Constant(I64, 1)) as (blk, _):
        b.store(scaled(blk, b.load(mx[0])), mx[0])
    m = [b.load(x) for x in mx]
    m = [b.select(b.fcmp_ordered(">", m[i], m[i + 2]), m[i], m[i + 2]) for i in range(2)]
    m = b.select(b.fcmp_ordered(">", m[0], m[1]), m[0], m[1])
    for half in (8, 4, 2, 1):
        o = shuffle(b, m, [i ^ half for i in range(16)])
        m = b.select(b.fcmp_ordered(">", o, m), o, m)
    mxv = splat(b, b.extract_element(m, ir.Constant(I32, 0)), 16)

    # e = ggml_v_expf(x - max), 0 outside a..e-1; block sums added in float64, in order
    f64 = ir.DoubleType()
    total = cgutils.alloca_once_value(b, ir.Constant(f64, 0.0))

    with cgutils.for_range(b, n_blk) as loop:
        x = b.load(at(loop.index), align=4)
        v = b.select(_lane_mask(b, cell(loop.index), a, e), _v_expf(b, b.fsub(x, mxv)), zero)
        b.store(v, at(loop.index), align=4)
    n_groups = b.sdiv(n_blk, ir.Constant(I64, 16))
    with cgutils.for_range(b, n_groups) as loop:
        first = b.mul(loop.index, ir.Constant(I64, 16))
        sums = _hsum16_each(b, [b.load(at(b.add(first, ir.Constant(I64, i))), align=4) for i in range(16)])
        t = b.load(total)
        for i in range(16):
            t = b.fadd(t, b.fpext(b.extract_element(sums, ir.Constant(I32, i)), f64))
        b.store(t, total)
    with cgutils.for_range_slice(b, b.mul(n_groups, ir.Constant(I64, 16)), n_blk, ir.Constant(I64, 1)) as (blk, _):
        b.store(b.fadd(b.load(total), b.fpext(hsum_f32(b, b.load(at(blk), align=4)), f64)), total)

    # probabilities e * float32(1 / total), rounded to f16, 16 blocks transposed at a time
    inv = splat(b, b.fptrunc(b.fdiv(ir.Constant(f64, 1.0), b.load(total)), F32), 16)
    h16 = vec(ir.HalfType(), 16)
    lane_bytes = b.mul(nb, ir.Constant(I64, 4))
    with cgutils.for_range_slice(b, ir.Constant(I64, 0), n_blk, ir.Constant(I64, 16)) as (first, _):
        ps = [b.fpext(b.fptrunc(b.fmul(b.load(at(b.add(first, ir.Constant(I64, i))), align=4), inv), h16), V16)
              for i in range(16)]
        m = b.add(b.ashr(a0, ir.Constant(I64, 4)), first)
        for lane, v in enumerate(_transpose16(b, ps)):
            at_lane = b.add(b.mul(ir.Constant(I64, lane), lane_bytes), b.mul(m, ir.Constant(I64, 4)))
            b.store(v, b.bitcast(b.gep(dst, [at_lane]), V16.as_pointer()), align=4)
    b.ret_void()
    return fn


@intrinsic
def _softmax_f16(typingctx, kq, off, a, e, scale, pl, p_off, nb):
    """_softmax_fn on the row kq[off:] (float32 1-D C), cells a..e-1 of it (scale float32), the
    probabilities by lane into pl[p_off:] (float32 1-D C, lane rows of nb)."""
    if not (_flat(kq, pl) and kq.dtype == types.float32 and pl.dtype == types.float32 and scale == types.float32):
        return None
    sig = types.void(kq, off, a, e, scale, pl, p_off, nb)

    def codegen(context, builder, signature, args):
        s = signature.args
        four = ir.Constant(I64, 4)
        row = builder.gep(_data(context, builder, s[0], args[0]), [builder.mul(_i64(context, builder, s[1], args[1]), four)])
        dst = builder.gep(_data(context, builder, s[5], args[5]), [builder.mul(_i64(context, builder, s[6], args[6]), four)])
        builder.call(_softmax_fn(builder.module), [row, _i64(context, builder, s[2], args[2]),
                                                   _i64(context, builder, s[3], args[3]), args[4], dst,
                                                   _i64(context, builder, s[7], args[7])])
        return context.get_dummy_value()

    return sig, codegen


def _kqv_group(module, lanes, r, nv):
    """void(vl, nblk, row_bytes, probs, p_stride, lane_bytes, lo, start, end, w, out, out_stride):
    out[i][0:16 nv] (float32 at out + i * out_stride bytes) = sum over the cells start <= j < end
    of V[j] * p_i[j] for r queries i (probabilities float32 rounded to f16, by lane: p_i[j] at
    probs + i * p_stride + (j % 16) * lane_bytes + (j - lo) // 16 * 4 bytes; lo a multiple of 16), V[j] the 16 nv float32 values at vl + ((c % 16) *
    nblk + c // 16) * row_bytes, c = j - lo (a chunk of _by_lane's order): cell j into lane accumulator
    j % lanes, in order, and the lanes added as ggml does. Cells are taken by j % 16 (16 runs);
    for 64 lanes the 4 accumulators of lanes j % 16 + 16 k are kept together and combined
    (a0 + a2) + (a1 + a3) at the end of the run. w: scratch float32[r, 16, 16 nv]."""
    fn, b = _function(module, f"edge_attn_kqv_{lanes}_{r}_{nv}",
                      [BYTE_PTR, I64, I64, BYTE_PTR, I64, I64, I64, I64, I64, BYTE_PTR, BYTE_PTR, I64])
    if b is None:
        return fn
    vl, nblk, row_bytes, probs, p_stride, lane_bytes, lo, start, end, w, out, out_stride = fn.args
    ng = lanes // 16
    zero = ir.Constant(V16, [0.0] * 16)
    c16, c64 = ir.Constant(I64, 16), ir.Constant(I64, 64)
    prow = [b.gep(probs, [b.mul(ir.Constant(I64, i), p_stride)]) for i in range(r)]
    accs = [[[cgutils.alloca_once(b, V16) for _ in range(ng)] for _ in range(nv)] for _ in range(r)]

    def cell(j, g):  # add cell j of this run's lane to the accumulators of lane group g
        m = b.ashr(b.sub(j, lo), ir.Constant(I64, 4))
        vp = b.gep(lane_rows, [b.mul(m, row_bytes)])
        ps = [splat(b, load(b, p, b.mul(m, ir.Constant(I64, 4)), F32), 16) for p in lane_probs]
        for c in range(nv):
            v = load(b, vp, 64 * c, V16)
            for i in range(r):
                b.store(fma(b, v, ps[i], b.load(accs[i][c][g])), accs[i][c][g])

    def w_at(i, lane, c):
        return b.bitcast(b.gep(w, [b.mul(b.add(b.mul(b.add(ir.Constant(I64, i * 16), lane), ir.Constant(I64, nv)),
                                                ir.Constant(I64, c)), c64)]), V16.as_pointer())

    with cgutils.for_range(b, c16) as lane_loop:
        lane = lane_loop.index
        lane_rows = b.gep(vl, [b.mul(b.mul(lane, nblk), row_bytes)])
        lane_probs = [b.gep(p, [b.mul(lane, lane_bytes)]) for p in prow]
        for x in (x for i in accs for c in i for x in c):
            b.store(zero, x)
        if ng == 1:
            j0 = b.add(start, b.and_(b.sub(lane, start), ir.Constant(I64, 15)))
            count = b.sdiv(b.add(b.sub(end, j0), ir.Constant(I64, 15)), c16)
            with cgutils.for_range(b, count) as cells:    # count <= 0: no iterations
                cell(b.add(j0, b.mul(cells.index, c16)), 0)
        else:
            # cells j = lane + 64 m + 16 g (lane group g) from the 64-cell run holding start
            base = b.add(lane, b.shl(b.ashr(b.sub(start, lane), ir.Constant(I64, 6)), ir.Constant(I64, 6)))
            runs = b.sdiv(b.add(b.sub(end, base), ir.Constant(I64, 63)), c64)
            with cgutils.for_range(b, runs) as run:
                first = b.add(base, b.mul(run.index, c64))
                for g in range(ng):
                    j = b.add(first, ir.Constant(I64, 16 * g))
                    with cgutils.if_likely(b, b.and_(b.icmp_signed(">=", j, start), b.icmp_signed("<", j, end))):
                        cell(j, g)
        for i in range(r):
            for c in range(nv):
                a = [b.load(x) for x in accs[i][c]]
                v = a[0] if ng == 1 else b.fadd(b.fadd(a[0], a[2]), b.fadd(a[1], a[3]))
                b.store(v, w_at(i, lane, c), align=4)

    for c in range(nv):
        def leaf(m):
            return [b.load(w_at(i, ir.Constant(I64, m), c), align=4) for i in range(r)]
        for i, v in enumerate(_tree16(b, leaf)):
            at = b.gep(out, [b.add(b.mul(ir.Constant(I64, i), out_stride), ir.Constant(I64, 64 * c))])
            b.store(v, b.bitcast(at, V16.as_pointer()), align=4)
    b.ret_void()
    return fn


_KQV_REGS = 24       # vector accumulators of a KQV pass (queries x head dims / 16 x lanes / 16)
_KQV_DIMS = {16: 24, 64: 1}  # most head-dim vectors of a pass: 64 lanes take more queries instead


def _kqv_pass(hd_v, lanes):
    """(queries, vectors of 16 head dims) of one _kqv_group pass."""
    nv = max(d for d in range(1, _KQV_DIMS[lanes] + 1) if (hd_v // 16) % d == 0)
    return max(1, _KQV_REGS // (nv * lanes // 16)), nv


def kqv_chunk(hd_v, lanes):
    """The chunk of V row elements one pass of _kqv_cells takes (_by_lane's chunk)."""
    return 16 * _kqv_pass(hd_v, lanes)[1]


@intrinsic
def _kqv_cells(typingctx, vl, nblk, pl, nb, q0, nq, lo, start, end, out, o0, w, hd_v, lanes):
    """out[o0 + i * hd_v + d] = sum over cells start <= j < end of V[j, d] * p_i[j] for queries
    i < nq, p_i[j] = pl[(q0 + i) * 16 nb + (j % 16) * nb + (j - lo) // 16] (probabilities rounded
    to f16 by lane, as _softmax_f16 leaves them), V the
    float32 rows of the cells lo .. lo + 16 nblk - 1 in _by_lane's order (chunks of
    kqv_chunk(hd_v, lanes) elements) in vl: llama.cpp's lane
    j % lanes (16: tinyBLAS, 64: ggml_vec_dot_f16) then its lane sum (_kqv_group). hd_v (a
    multiple of 16) and lanes literal; arrays 1-D C float32; w: scratch float32[>= _KQV_REGS *
    256]."""
    if not (isinstance(hd_v, types.IntegerLiteral) and isinstance(lanes, types.IntegerLiteral)
            and _flat(vl, pl, out, w)):
        return None
    hd_v_, lanes_ = hd_v.literal_value, lanes.literal_value
    per, nv = _kqv_pass(hd_v_, lanes_)
    sig = types.void(vl, nblk, pl, nb, q0, nq, lo, start, end, out, o0, w, hd_v, lanes)

    def codegen(context, builder, signature, args):
        s = signature.args
        vp, kqp, outp, wp = (_data(context, builder, s[i], args[i]) for i in (0, 2, 9, 11))
        nblk_, nb_, q0_, nq_, lo_, start_, end_, o0_ = (_i64(context, builder, s[i], args[i])
                                                        for i in (1, 3, 4, 5, 6, 7, 8, 10))
        lane_bytes = builder.mul(nb_, ir.Constant(I64, 4))
        p_stride = builder.mul(lane_bytes, ir.Constant(I64, 16))
        row_bytes = ir.Constant(I64, 64 * nv)      # one chunk of a row
        chunk_bytes = builder.mul(builder.mul(nblk_, ir.Constant(I64, 16)), row_bytes)

        def body(first, count):
            fn = _kqv_group(builder.module, lanes_, count, nv)
            probs = builder.gep(kqp, [builder.mul(builder.add(q0_, first), p_stride)])
            o = builder.gep(outp, [builder.mul(builder.add(o0_, builder.mul(first, ir.Constant(I64, hd_v_))),
                                               ir.Constant(I64, 4))])
            for d0 in range(0, hd_v_, 16 * nv):
                builder.call(fn, [builder.gep(vp, [builder.mul(chunk_bytes, ir.Constant(I64, d0 // (16 * nv)))]), nblk_,
                                  row_bytes, probs, p_stride, lane_bytes, lo_, start_, end_, wp,
                                  builder.gep(o, [ir.Constant(I64, 4 * d0)]), ir.Constant(I64, 4 * hd_v_)])
        _groups(builder, nq_, per, body)
        return context.get_dummy_value()

    return sig, codegen
