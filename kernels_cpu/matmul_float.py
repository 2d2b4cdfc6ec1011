"""F32 / F16 / BF16 weight matmuls with one summation order on every CPU.

out[t, r] = sum_k W[r, k] * x[t, k] (x already rounded to f16 / bf16 for those weights) as
llama.cpp's tinyBLAS computes one output on x86 with AVX-512 F (llamafile's sgemm,
``tinyBLAS<16, __m512, ...>``): 16 float lanes, lane j the fused multiply-add chain of the
values k = j (mod 16) in order, then _mm512_reduce_add_ps (halves added lane by lane:
simd.hsum_f32). The K % 16 last values (tinyBLAS takes no such K; edge's own rule) follow in
order as a scalar fma chain on that sum. F16 and BF16 products are exact in float32, so there
fma and multiply-then-add agree.

The lanes are LLVM vectors of 16 floats whatever the CPU: two ymm with AVX2, four xmm
without, the same bits everywhere (these kernels used to be plain loops with reassociation
allowed, which LLVM vectorized 8 wide for AVX2 and 16 wide for AVX-512: other logits per CPU).
Tiles of NRF weight rows x one activation row (independent chains, the weight rows read once
per activation row from cache).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels_cpu.simd import BYTE_PTR, F32, I16, I32, I64, fma, hsum_f32, load, vec

F32_W, F16_W, BF16_W = 0, 1, 2   # weight kinds (literal arguments of fdot_rows)
NRF = 4                          # weight rows per tile
_LANES = 16
_BYTES = {F32_W: 4, F16_W: 2, BF16_W: 2}


def _weights(b: ir.IRBuilder, kind: int, p, at, n: int):
    """<n x float> (or float for n == 1) of the ``kind`` weights at i8* p + at bytes."""
    if kind == F32_W:
        return load(b, p, at, vec(F32, n) if n > 1 else F32)
    if kind == F16_W:
        return b.fpext(load(b, p, at, vec(ir.HalfType(), n) if n > 1 else ir.HalfType()), vec(F32, n) if n > 1 else F32)
    i32 = vec(I32, n) if n > 1 else I32
    bits = b.shl(b.zext(load(b, p, at, vec(I16, n) if n > 1 else I16), i32),
                 ir.Constant(i32, [16] * n) if n > 1 else ir.Constant(I32, 16))
    return b.bitcast(bits, vec(F32, n) if n > 1 else F32)


def _fma_step(b: ir.IRBuilder, kind: int, rows: list, x, i, n: int, accs: list) -> list:
    """accs[r] + w[r][n i : n i + n] * x[n i : n i + n], fused (n floats a vector, or 1)."""
    xv = load(b, x, b.mul(i, ir.Constant(I64, 4 * n)), vec(F32, n) if n > 1 else F32)
    at = b.mul(i, ir.Constant(I64, _BYTES[kind] * n))
    return [fma(b, _weights(b, kind, row, at, n), xv, acc) for row, acc in zip(rows, accs)]


def _loop_back(b: ir.IRBuilder, counter, loop, end, exit_):
    """counter + 1; back to ``loop`` while below ``end``, else on to ``exit_``."""
    nxt = b.add(counter, ir.Constant(I64, 1))
    counter.add_incoming(nxt, loop)
    b.cbranch(b.icmp_signed("<", nxt, end), loop, exit_)


def _build(module: ir.Module, kind: int, nr: int, name: str) -> ir.Function:
    """``void name(i8* w, i64 w_stride, i8* x, float* out, i64 out_r_stride, i64 k)``: out[i *
    out_r_stride] = the module docstring's dot of weight row i (w + i * w_stride bytes) and the
    float32 row x, i < nr, over k values."""
    v16 = vec(F32, _LANES)
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [BYTE_PTR, I64, BYTE_PTR, F32.as_pointer(), I64, I64]),
                     name)
    fn.linkage = "internal"
    w, w_stride, x, out, out_stride, k = fn.args
    entry, loop, reduce_, tail, done = (fn.append_basic_block(n) for n in ("entry", "loop", "reduce", "tail", "done"))
    b = ir.IRBuilder(entry)
    rows = [b.gep(w, [b.mul(ir.Constant(I64, i), w_stride)]) for i in range(nr)]
    nblk = b.sdiv(k, ir.Constant(I64, _LANES))
    zero = ir.Constant(v16, [0.0] * _LANES)
    b.cbranch(b.icmp_signed(">", nblk, ir.Constant(I64, 0)), loop, reduce_)

    b.position_at_end(loop)
    blk = b.phi(I64)
    blk.add_incoming(ir.Constant(I64, 0), entry)
    accs = [b.phi(v16) for _ in range(nr)]
    new = _fma_step(b, kind, rows, x, blk, _LANES, accs)
    for acc, v in zip(accs, new):
        acc.add_incoming(zero, entry)
        acc.add_incoming(v, loop)
    _loop_back(b, blk, loop, nblk, reduce_)

    b.position_at_end(reduce_)
    phis = [b.phi(v16) for _ in range(nr)]
    for phi, v in zip(phis, new):
        phi.add_incoming(zero, entry)
        phi.add_incoming(v, loop)
    finals = [hsum_f32(b, phi) for phi in phis]
    k16 = b.mul(nblk, ir.Constant(I64, _LANES))
    b.cbranch(b.icmp_signed("<", k16, k), tail, done)

    b.position_at_end(tail)   # the K % 16 last values, one scalar fma each, in order
    kk = b.phi(I64)
    kk.add_incoming(k16, reduce_)
    sums = [b.phi(F32) for _ in range(nr)]
    upd = _fma_step(b, kind, rows, x, kk, 1, sums)
    for s, f, u in zip(sums, finals, upd):
        s.add_incoming(f, reduce_)
        s.add_incoming(u, tail)
    _loop_back(b, kk, tail, k, done)

    b.position_at_end(done)
    phis = [b.phi(F32) for _ in range(nr)]
    for i, phi in enumerate(phis):
        phi.add_incoming(finals[i], reduce_)
        phi.add_incoming(upd[i], tail)
    for i, phi in enumerate(phis):
        b.store(phi, b.gep(out, [b.mul(ir.Constant(I64, i), out_stride)]))
    b.ret_void()
    return fn


@intrinsic
def fdot_rows(typingctx, kind, nr, w, r0, x, t, out):
    """out[t, r0 + i] = dot(w[r0 + i], x[t]) (module docstring) for i < nr; ``kind`` (F32_W,
    F16_W, BF16_W) and ``nr`` literals, w float32[R, K] or uint16[R, K] (f16 / bf16 bits),
    x float32[T, K], out float32[T, R], all C-contiguous."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (kind, nr)):
        return None
    k_, n_r = kind.literal_value, nr.literal_value
    sig = types.void(kind, nr, w, r0, x, t, out)

    def codegen(context, builder, signature, args):
        name = f"edge_fdot_{k_}_{n_r}"
        fn = builder.module.globals.get(name) or _build(builder.module, k_, n_r, name)
        aw, ax, aout = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (2, 4, 6))
        r0v, tv = (builder.sext(v, I64) if v.type != I64 else v for v in (args[3], args[5]))
        stride = lambda a: cgutils.unpack_tuple(builder, a.strides)[0]  # noqa: E731
        base = lambda a, i: builder.gep(builder.bitcast(a.data, BYTE_PTR), [builder.mul(i, stride(a))])  # noqa: E731
        out_stride = builder.sdiv(stride(aout), ir.Constant(I64, 4))
        out_at = builder.gep(aout.data, [builder.add(builder.mul(tv, out_stride), r0v)])
        k = cgutils.unpack_tuple(builder, ax.shape)[1]
        builder.call(fn, [base(aw, r0v), stride(aw), base(ax, tv), out_at, ir.Constant(I64, 1), k])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _float_matmul(kind, w, x, out):
    """fdot_rows over all outputs: NRF-row tiles (the last overlapping its neighbour: the same
    bits), one row at a time when R < NRF."""
    R, T = w.shape[0], x.shape[0]
    if R < NRF:
        for r in range(R):
            for t in range(T):
                fdot_rows(kind, 1, w, r, x, t, out)
        return
    for g in prange((R + NRF - 1) // NRF):
        r0 = min(np.int64(g) * NRF, R - NRF)
        for t in range(T):
            fdot_rows(kind, NRF, w, r0, x, t, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_f32_f32(w, x, out):
    """F32 weights w float32[R, K] x float32 x[T, K] -> out[T, R] (module docstring)."""
    _float_matmul(F32_W, w, x, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_f16_f16(w, x, out):
    """F16 weights w uint16[R, K] (binary16 bits) x x[T, K] already rounded to f16 (as float32)."""
    _float_matmul(F16_W, w, x, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_bf16_bf16(w, x, out):
    """BF16 weights w uint16[R, K] (bf16 bits) x x[T, K] already rounded to bf16 (as float32)."""
    _float_matmul(BF16_W, w, x, out)
