"""The machine's two physical ceilings, measured by short calibrated loops: memory read bandwidth
(what one-row decode is bound by: each token reads every weight once) and int8 multiply-add
throughput (what prefill, batched decode and verification are bound by).

* :func:`read_bandwidth` streams a buffer larger than the caches through every thread with wide
  vector loads (8 x 32 bytes per loop step, OR-ed together so nothing is optimised away) and
  returns the best bytes per second of a few passes.
* :func:`int8_throughput` runs, on every thread, a register-only loop of the instruction edge's
  int8 tiles use on this CPU (kernels_cpu.simd.kernel_path): ``vpdpbusd`` zmm with AVX-512 VNNI (64
  multiply-adds each), ``vpdpbusd`` ymm with AVX-VNNI (32), else ``vpmaddubsw`` + ``vpmaddwd`` +
  ``vpaddd`` ymm with AVX2 (32), else
  16 int8 products widened to int32 (plain LLVM vectors), in 8 independent chains so that the
  latency is hidden; returns int8 multiply-adds per second.

Both return the best of ``repeats`` timings: a ceiling is what the machine can do, not its
average under load. numba's on-disk cache keys these kernels on this file.
"""
from __future__ import annotations

import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from kernels_cpu.simd import (BYTE_PTR, HAS_AVX2, HAS_AVX_VNNI, HAS_VNNI, I8, I16, I32, I64, _x86_call,  # noqa: F401
                              kernel_path, target_features, vec)

CHUNK = 1 << 20  # bytes per parallel work item of the bandwidth loop
_STEP = 256  # bytes per loop step: 8 loads of 32 bytes


def _loop(b: ir.IRBuilder, fn: ir.Function, n, state: list, step):
    """Emit ``for i in range(n): state = step(b, i, state)`` (n >= 1, i64) into fn; returns the
    final state (a list of IR values)."""
    entry = b.block
    body, done = fn.append_basic_block("body"), fn.append_basic_block("done")
    b.branch(body)
    b.position_at_end(body)
    i = b.phi(I64)
    i.add_incoming(ir.Constant(I64, 0), entry)
    phis = [b.phi(v.type) for v in state]
    for phi, v in zip(phis, state):
        phi.add_incoming(v, entry)
    new = step(b, i, phis)
    for phi, v in zip(phis, new):
        phi.add_incoming(v, b.block)
    nxt = b.add(i, ir.Constant(I64, 1))
    i.add_incoming(nxt, b.block)
    b.cbranch(b.icmp_signed("<", nxt, n), body, done)
    b.position_at_end(done)
    return new


def _read_fn(module: ir.Module) -> ir.Function:
    """``i64 edge_read_bytes(i8* p, i64 n_steps)``: OR of every 8-byte word of p[0 : 256 n_steps]."""
    name = "edge_read_bytes"
    if module.globals.get(name):
        return module.globals[name]
    v4 = vec(I64, 4)
    fn = ir.Function(module, ir.FunctionType(I64, [BYTE_PTR, I64]), name)
    fn.linkage = "internal"
    p, n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))

    def step(b, i, accs):
        base = b.gep(p, [b.mul(i, ir.Constant(I64, _STEP))])
        return [b.or_(acc, b.load(b.bitcast(b.gep(base, [ir.Constant(I64, 32 * k)]), v4.as_pointer()), align=1))
                for k, acc in enumerate(accs)]

    accs = _loop(b, fn, n, [ir.Constant(v4, [0] * 4)] * 8, step)
    v = accs[0]
    for acc in accs[1:]:
        v = b.or_(v, acc)
    out = b.extract_element(v, ir.Constant(I32, 0))
    for k in range(1, 4):
        out = b.or_(out, b.extract_element(v, ir.Constant(I32, k)))
    b.ret(out)
    return fn


def _madd_fn(module: ir.Module) -> ir.Function:
    """``i32 edge_int8_loop(i64 n_iter, i32 seed)``: 8 chains of n_iter int8 multiply-add steps on
    registers (module docstring); returns a value that depends on all of them."""
    name = "edge_int8_loop"
    if module.globals.get(name):
        return module.globals[name]
    fn = ir.Function(module, ir.FunctionType(I32, [I64, I32]), name)
    fn.linkage = "internal"
    n, seed = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    width = 16 if HAS_VNNI else 8 if HAS_AVX2 else 16  # i32 lanes: zmm / ymm / plain vectors
    vi = vec(I32, width)
    s = b.insert_element(ir.Constant(vi, ir.Undefined), seed, ir.Constant(I32, 0))
    s = b.shuffle_vector(s, ir.Constant(vi, ir.Undefined), ir.Constant(vec(I32, width), [0] * width))
    ops = [b.xor(s, ir.Constant(vi, [0x01020304 * (k + 1)] * width)) for k in range(9)]

    def step(b, i, accs):
        if HAS_VNNI or HAS_AVX_VNNI:
            name = f"llvm.x86.avx512.vpdpbusd.{32 * width}"
            return [_x86_call(b, name, [acc, ops[8], ops[k]]) for k, acc in enumerate(accs)]
        if not HAS_AVX2:  # no int8 instruction edge uses: 16 widened products per chain (what LLVM makes of them)
            a = b.sext(b.trunc(ops[8], vec(I8, width)), vi)
            return [b.add(acc, b.mul(a, b.sext(b.trunc(b.xor(ops[k], acc), vec(I8, width)), vi)))
                    for k, acc in enumerate(accs)]
        ones = ir.Constant(vec(I16, 16), [1] * 16)
        out = []
        for k, acc in enumerate(accs):
            p16 = _x86_call(b, "llvm.x86.avx2.pmadd.ub.sw", [b.bitcast(ops[8], vec(I8, 32)),
                                                              b.bitcast(b.xor(ops[k], acc), vec(I8, 32))], vec(I16, 16))
            out.append(b.add(acc, _x86_call(b, "llvm.x86.avx2.pmadd.wd", [p16, ones], vi)))
        return out

    accs = _loop(b, fn, n, [ir.Constant(vi, [0] * width)] * 8, step)
    v = accs[0]
    for acc in accs[1:]:
        v = b.add(v, acc)
    b.ret(b.extract_element(v, ir.Constant(I32, 0)))
    return fn


MACS_PER_STEP = 8 * (64 if HAS_VNNI else 32 if HAS_AVX2 else 16)  # int8 multiply-adds per step of edge_int8_loop


@intrinsic
def _read_bytes(typingctx, buf, start, n_steps):
    """OR of the 8-byte words of buf[start : start + 256 n_steps] (buf a 1-D uint8 array)."""
    sig = types.uint64(buf, start, n_steps)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        p = builder.gep(builder.bitcast(arr.data, BYTE_PTR), [args[1]])
        return builder.call(_read_fn(builder.module), [p, args[2]])

    return sig, codegen


@intrinsic
def _int8_loop(typingctx, n_iter, seed):
    """edge_int8_loop(n_iter, seed) (n_iter >= 1)."""
    sig = types.int32(n_iter, seed)

    def codegen(context, builder, signature, args):
        return builder.call(_madd_fn(builder.module), [args[0], builder.trunc(args[1], I32)])

    return sig, codegen


@njit(parallel=True, cache=True, nogil=True)
def _read_all(buf, out):
    """out[c] = OR of chunk c of buf (CHUNK bytes each; buf.size a multiple of CHUNK)."""
    for c in prange(buf.size // CHUNK):
        out[c] = _read_bytes(buf, np.int64(c) * CHUNK, np.int64(CHUNK // _STEP))


@njit(parallel=True, cache=True, nogil=True)
def _madd_all(n_iter, out):
    """out[k] = edge_int8_loop(n_iter, k) for every k (one item per thread)."""
    for k in prange(out.size):
        out[k] = _int8_loop(np.int64(n_iter), np.int64(k + 1))


def read_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best memory read bandwidth of the numba threads, bytes/s, over ``repeats`` fresh buffers of
    ``n_bytes`` (rounded up to CHUNK; it should exceed the last-level cache several times), each
    touched once, then read twice. Fresh buffers, because on a virtual machine the same loop
    reads one buffer at about 33 GB/s and the next at 55 (where the host placed the pages; seen
    on the 2-core AVX-512 host): the ceiling is the best placement."""
    n = max(1, -(-n_bytes // CHUNK)) * CHUNK
    out = np.empty(n // CHUNK, np.uint64)
    best = float("inf")
    for _ in range(repeats):
        buf = np.ones(n, np.uint8)
        _read_all(buf, out)
        for _ in range(2):
            t0 = time.perf_counter()
            _read_all(buf, out)
            best = min(best, time.perf_counter() - t0)
        del buf
    return n / best


def int8_throughput(threads: int, seconds: float = 0.05, repeats: int = 5) -> float:
    """Best int8 multiply-adds per second of ``threads`` numba threads (each runs the loop of
    the module docstring for about ``seconds``)."""
    from numba import get_num_threads

    n = max(1, min(threads, get_num_threads()))
    out = np.empty(n, np.int32)
    n_iter = 1000
    _madd_all(n_iter, out)
    while True:  # calibrate the loop length to the wanted duration
        t0 = time.perf_counter()
        _madd_all(n_iter, out)
        dt = time.perf_counter() - t0
        if dt >= seconds / 4 or n_iter > 1 << 34:
            break
        n_iter *= 4
    n_iter = max(1000, int(n_iter * seconds / dt))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _madd_all(n_iter, out)
        best = min(best, time.perf_counter() - t0)
    return n * n_iter * MACS_PER_STEP / best


def features() -> str:
    """The CPU features numba compiles for, as a short string of the ones edge's kernels use."""
    want = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avxvnni")
    return ",".join(f for f in want if f"+{f}" in target_features())
