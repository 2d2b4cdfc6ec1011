"""qdot_tile, the numba intrinsic that calls one generated matmul tile, and the loops that tile
a whole matmul with it.

Tile shapes: NR x NT for T >= NT, over chunks of TC activation rows (so the chunk stays in
cache), and ND x 1 for fewer rows (decode), with the ND rows R // ND apart (adjacent rows in one
tile stream from DRAM at half the speed of one row); with AVX-512 VNNI, panels of 16 weight rows
x up to PANEL_T activation rows (``qdot_panel``, kernels_cpu.matmul_panel) for the types and
paths with one weight row per lane when T >= 2 (``many_rows``). Results do not depend on the
tiling, so edge tiles overlap their neighbours instead of being smaller. The tile's IR comes
from kernels_cpu.matmul_tiles, or on CPUs with AVX-512 VNNI for some types and paths from
kernels_cpu.matmul_rows / kernels_cpu.matmul_vnni (same float operations), on AVX2 CPUs
without it (and arm64 with DotProd) for Q4_0 / Q5_0 / Q8_0 on path VEC_DOT from
kernels_cpu.matmul_avx2 and for Q2_K .. Q6_K on every path from kernels_cpu.kquant_int8 (Q4_K
GEMV / GEMM in 8-row tiles, ``kq_rows``), and on every CPU
with AVX2 for Q4_1 / Q5_1 (VEC_DOT) from kernels_cpu.matmul_avx2, for IQ4_NL / IQ4_XS / MXFP4
from kernels_cpu.iq4_avx2 and for IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S (their only
tiles) from kernels_cpu.iq23_avx2; for IQ1_S / IQ1_M / TQ1_0 /
TQ2_0 (their only tiles) from kernels_cpu.iq1tq_avx2.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels_cpu.iq1tq_avx2 import AVX2_IQ1TQ_PATHS, build_avx2_iq1tq_tile
from kernels_cpu.iq1tq_avx2 import FORMATS as IQ1TQ_FORMATS
from kernels_cpu.iq4_avx2 import AVX2_IQ4_PATHS, build_avx2_iq4_tile
from kernels_cpu.iq4_decoders import FORMATS as IQ4_FORMATS
from kernels_cpu.iq23_avx2 import AVX2_IQ23_PATHS, build_avx2_iq23_tile
from kernels_cpu.iq23_avx2 import FORMATS as IQ23_FORMATS
from kernels_cpu.kquant_int8 import KQUANT_PATHS, KQUANT_ROWS_PATHS, build_kquant_rows_tile, build_kquant_tile
from kernels_cpu.matmul_avx2 import build_avx2_tile
from kernels_cpu.matmul_decoders import FORMATS
from kernels_cpu.matmul_panel import PANEL_ROWS, PANEL_T, build_panel
from kernels_cpu.matmul_rows import ROWS, build_rows_tile
from kernels_cpu.matmul_tiles import GEMV, PATH_NAMES, TILED, VEC_DOT, build_tile
from kernels_cpu.matmul_vnni import build_vnni_tile
from kernels_cpu.simd import BYTE_PTR, HAS_AVX2, HAS_DOTPROD, HAS_INT8_VEC_DOT, HAS_VNNI, I64

T_ = GGMLQuantizationType
# every quantized type's IR decoder (IQ1 / IQ2 / IQ3 / TQ: their AVX2 tiles only)
FORMATS = {**FORMATS, **IQ4_FORMATS, **IQ23_FORMATS, **IQ1TQ_FORMATS}
NR, NT = 4, 4  # prefill tile: weight rows x activation rows
TC = 64  # activation rows per prefill chunk
ND = 4  # decode tile rows, R // ND apart (adjacent rows in one tile stream from DRAM at half speed)
# Q4_K (repacked) and Q6_K with AVX-512 VNNI: tiles of 8 rows, one per lane (kernels_cpu.matmul_rows)
NR_ROWS = ROWS if HAS_VNNI else NR
# Q4_K (repacked) with AVX2 int8 or DotProd: 8-row tiles too (kernels_cpu.kquant_int8)
NR_KQ = ROWS if HAS_VNNI or HAS_INT8_VEC_DOT else NR
NT_WIDE = 8 if HAS_VNNI else 0  # Q5_0 / Q8_0 GEMV rows tiles: 8 activation rows per weight decoding
NR_Q0 = 8 if HAS_VNNI else NR  # Q5_0 / Q8_0 with AVX-512 VNNI: 8 rows in pairs (kernels_cpu.matmul_vnni)
ND_Q6_K = 2 if HAS_VNNI else NR  # Q6_K vec_dot (T < 8) with VNNI: one row pair per tile (kernels_cpu.matmul_vnni)


@intrinsic
def qdot_tile(typingctx, fmt, path, nr, nt, w, r0, r_step, xq, xd, xa, t0, out):
    """out[t0 + t, r0 + r * r_step] = llama.cpp's dot(w[r0 + r * r_step], x[t0 + t]) for r < nr, t < nt.

    ``fmt`` (GGML type id of w), ``path`` (VEC_DOT, TILED, GEMV, GEMM), nr, nt are literals;
    r_step >= 0 (0: one row nr times); xq int8[T, K] or int16[T, K] quants, xd float32[T, K/block]
    scales, xa the Q8_1 sums float32[T, K/32] or the Q8_K bsums int16[T, K/16] (ignored for
    Q8_0), out float32[T, R] C-contiguous.
    """
    if not all(isinstance(a, types.IntegerLiteral) for a in (fmt, path, nr, nt)):
        return None
    if not isinstance(xq, types.Array) or xq.dtype not in (types.int8, types.int16):
        return None
    f = FORMATS[GGMLQuantizationType(fmt.literal_value)]
    p, n_r, n_t = path.literal_value, nr.literal_value, nt.literal_value
    sig = types.void(fmt, path, nr, nt, w, r0, r_step, xq, xd, xa, t0, out)

    def codegen(context, builder, signature, args):
        x16 = signature.args[7].dtype == types.int16
        name = f"edge_qdot_{f.ggml_type.name.lower()}_{PATH_NAMES[p]}_{n_r}x{n_t}{'_x16' if x16 else ''}"
        if builder.module.globals.get(name):
            fn = builder.module.globals.get(name)
        elif HAS_VNNI and p == VEC_DOT and f.ggml_type in (T_.Q5_0, T_.Q8_0, T_.Q6_K):
            fn = build_vnni_tile(builder.module, f.ggml_type.name, n_r, n_t, name, x16)
        elif p == VEC_DOT and (HAS_INT8_VEC_DOT and f.ggml_type in (T_.Q4_0, T_.Q5_0, T_.Q8_0)
                               or (HAS_AVX2 or HAS_DOTPROD) and f.ggml_type in (T_.Q4_1, T_.Q5_1)):
            fn = build_avx2_tile(builder.module, f.ggml_type.name, n_r, n_t, name, x16)
        elif HAS_INT8_VEC_DOT and n_r == ROWS and (f.ggml_type, p) in KQUANT_ROWS_PATHS:
            fn = build_kquant_rows_tile(builder.module, f.ggml_type, p, n_t, name, x16)
        elif (HAS_INT8_VEC_DOT or HAS_VNNI and n_r < ROWS and (f.ggml_type, p) == (T_.Q6_K, TILED)) \
                and (f.ggml_type, p) in KQUANT_PATHS:
            fn = build_kquant_tile(builder.module, f.ggml_type, p, n_r, n_t, name, x16)
        elif n_r == ROWS and HAS_VNNI and (p == GEMV and f.ggml_type in (T_.IQ4_NL, T_.MXFP4, T_.Q4_0)
                                           or p == TILED and f.ggml_type == T_.IQ4_XS):
            fn = build_rows_tile(builder.module, f.ggml_type.name, PATH_NAMES[p], n_t, name, x16)
        elif HAS_AVX2 and (f.ggml_type, p) in AVX2_IQ4_PATHS:
            fn = build_avx2_iq4_tile(builder.module, f.ggml_type, p, n_r, n_t, name, x16)
        elif HAS_AVX2 and (f.ggml_type, p) in AVX2_IQ23_PATHS:
            fn = build_avx2_iq23_tile(builder.module, f.ggml_type, p, n_r, n_t, name, x16)
        elif HAS_AVX2 and (f.ggml_type, p) in AVX2_IQ1TQ_PATHS:
            fn = build_avx2_iq1tq_tile(builder.module, f.ggml_type, p, n_r, n_t, name, x16)
        elif n_r == ROWS and HAS_VNNI and (f.ggml_type in (T_.Q4_K, T_.Q6_K)
                                           or (p == GEMV and f.ggml_type in (T_.Q8_0, T_.Q5_0))):
            fn = build_rows_tile(builder.module, f.ggml_type.name, PATH_NAMES[p], n_t, name, x16)
        else:
            fn = build_tile(builder.module, f, p, n_r, n_t, name, x16)
        arrays = [context.make_array(ty)(context, builder, v) for ty, v in
                  zip(signature.args[4:], args[4:]) if isinstance(ty, types.Array)]
        aw, axq, axd, axa, aout = arrays
        r0v, r_stepv, t0v = (builder.sext(v, I64) if v.type != I64 else v for v in (args[5], args[6], args[10]))
        stride = lambda a: cgutils.unpack_tuple(builder, a.strides)[0]  # noqa: E731

        def base(a, i):
            ptr = builder.bitcast(a.data, BYTE_PTR)
            return builder.gep(ptr, [builder.mul(i, stride(a))])

        out_stride = builder.sdiv(stride(aout), ir.Constant(I64, 4))
        out_at = builder.gep(aout.data, [builder.add(builder.mul(t0v, out_stride), r0v)])
        nb = builder.sdiv(cgutils.unpack_tuple(builder, aw.shape)[1], ir.Constant(I64, f.block_bytes))
        builder.call(fn, [base(aw, r0v), builder.mul(stride(aw), r_stepv), base(axq, t0v), stride(axq),
                          base(axd, t0v), stride(axd), base(axa, t0v), stride(axa), out_at, out_stride, r_stepv, nb])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def qdot_panel(typingctx, fmt, path, w, r0, xq, xd, xa, t0, nt, out):
    """out[t0 + t, r0 + r] = the path's dot(w[r0 + r], x[t0 + t]) for r < PANEL_ROWS, t < nt <=
    PANEL_T (kernels_cpu.matmul_panel; AVX-512 VNNI; arguments as qdot_tile's)."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (fmt, path)):
        return None
    if not isinstance(xq, types.Array) or xq.dtype not in (types.int8, types.int16):
        return None
    f = FORMATS[GGMLQuantizationType(fmt.literal_value)]
    p = path.literal_value
    sig = types.void(fmt, path, w, r0, xq, xd, xa, t0, nt, out)

    def codegen(context, builder, signature, args):
        x16 = signature.args[4].dtype == types.int16
        name = f"edge_panel_{f.ggml_type.name.lower()}_{PATH_NAMES[p]}{'_x16' if x16 else ''}"
        fn = builder.module.globals.get(name) or build_panel(builder.module, f.ggml_type.name, PATH_NAMES[p], name, x16)
        aw, axq, axd, axa, aout = (context.make_array(signature.args[i])(context, builder, args[i])
                                   for i in (2, 4, 5, 6, 9))
        r0v, t0v, ntv = (builder.sext(v, I64) if v.type != I64 else v for v in (args[3], args[7], args[8]))
        stride = lambda a: cgutils.unpack_tuple(builder, a.strides)[0]  # noqa: E731

        def base(a, i):
            return builder.gep(builder.bitcast(a.data, BYTE_PTR), [builder.mul(i, stride(a))])

        out_stride = builder.sdiv(stride(aout), ir.Constant(I64, 4))
        out_at = builder.gep(aout.data, [builder.add(builder.mul(t0v, out_stride), r0v)])
        nb = builder.sdiv(cgutils.unpack_tuple(builder, aw.shape)[1], ir.Constant(I64, f.block_bytes))
        builder.call(fn, [base(aw, r0v), stride(aw), base(axq, t0v), stride(axq), base(axd, t0v), stride(axd),
                          base(axa, t0v), stride(axa), out_at, out_stride, ntv, nb])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _panels(fmt, path, w, xq, xd, xa, out):
    """qdot_panel over all outputs (R >= PANEL_ROWS): panels of PANEL_ROWS weight rows (the last
    overlapping its neighbour: results do not depend on tiling) x chunks of at most PANEL_T
    activation rows (equal chunks, so that threads share evenly); a thread takes the row panels
    of one chunk in order (the chunk's activations stay in cache)."""
    R, T = w.shape[0], xq.shape[0]
    n_rt = (R + PANEL_ROWS - 1) // PANEL_ROWS
    n_tc = (T + PANEL_T - 1) // PANEL_T
    chunk = (T + n_tc - 1) // n_tc
    for job_ in prange(n_rt * n_tc):
        job = np.int64(job_)
        t_lo = (job // n_rt) * chunk
        r0 = min((job % n_rt) * PANEL_ROWS, R - PANEL_ROWS)
        qdot_panel(fmt, path, w, r0, xq, xd, xa, t_lo, min(T, t_lo + chunk) - t_lo, out)


@njit(cache=True, inline="always")
def _block_sums_32(xqs, factor):
    """int32[T, K/32]: ``factor`` times the sum of each 32-value block of the activation quants
    (int8 or int16); exact (|factor * sum| <= 128 * 32 * 128)."""
    out = np.empty((xqs.shape[0], xqs.shape[1] // 32), np.int32)
    for t in prange(xqs.shape[0]):
        for blk in range(out.shape[1]):
            total = 0
            for j in range(32 * blk, 32 * blk + 32):
                total += np.int32(xqs[t, j])
            out[t, blk] = total * factor
    return out


@njit(cache=True, inline="always")
def _rows(fmt, path, nd, w, xq, xd, xa, out):
    """qdot_tile in ND x 1 tiles only, for few activation rows (decode): a tile takes rows j,
    j + R // ND, ... (each thread streams ND far-apart row ranges; ND adjacent rows per tile
    stream from DRAM at half the speed) for every t. The R % ND last rows: one tile over the
    last ND rows (recomputing some: results do not depend on tiling), or, when R < ND, a tile
    repeating each row."""
    R, T = w.shape[0], xq.shape[0]
    part = R // nd
    for j in prange(part):
        for t in range(T):
            qdot_tile(fmt, path, nd, 1, w, j, part, xq, xd, xa, t, out)
    for t in range(T):
        if part == 0:
            for r in range(R):
                qdot_tile(fmt, path, nd, 1, w, r, 0, xq, xd, xa, t, out)
        elif R % nd:
            qdot_tile(fmt, path, nd, 1, w, R - nd, 1, xq, xd, xa, t, out)


@njit(cache=True, inline="always")
def _blocks(fmt, path, nr, tails, w, xq, xd, xa, out, wide=0):
    """qdot_tile in NR x NT tiles (T >= NT) over chunks of at most TC activation rows (equal
    chunks, a multiple of NT, so threads share evenly and a chunk stays in cache); the last
    NT-tile of a chunk overlaps its neighbour, or with ``tails`` (a literal) the rows left are
    done in ND x 1 tiles. The last row tile overlaps its neighbour (recomputed values are
    identical: results do not depend on tiling); with R < NR a tile repeats one row.
    ``wide`` (a literal, 0 or a multiple of NT): tiles of that many activation rows first, for
    tiles whose cost is mostly preparing the weights (kernels_cpu.matmul_rows GEMV tiles)."""
    R, T = w.shape[0], xq.shape[0]
    n_rt = (R + nr - 1) // nr
    n_tc = (T + TC - 1) // TC
    chunk = ((T + n_tc - 1) // n_tc + NT - 1) // NT * NT
    for job_ in prange(n_rt * n_tc):
        job = np.int64(job_)
        t_lo = (job // n_rt) * chunk
        t_hi = min(T, t_lo + chunk)
        for k in range(1 if R >= nr else R):
            r0 = min((job % n_rt) * nr, R - nr) if R >= nr else k
            step = 1 if R >= nr else 0
            t = t_lo
            if wide:
                while t + wide <= t_hi:
                    qdot_tile(fmt, path, nr, wide, w, r0, step, xq, xd, xa, t, out)
                    t += wide
            while t + NT <= t_hi:
                qdot_tile(fmt, path, nr, NT, w, r0, step, xq, xd, xa, t, out)
                t += NT
            if tails:
                while t < t_hi:
                    qdot_tile(fmt, path, nr, 1, w, r0, step, xq, xd, xa, t, out)
                    t += 1
            elif t < t_hi:
                qdot_tile(fmt, path, nr, NT, w, r0, step, xq, xd, xa, t_hi - NT, out)


@njit(cache=True, inline="always")
def _tiled(fmt, path, nr, w, xq, xd, xa, out, wide=0):
    """Run qdot_tile of ``path`` over all outputs: ND x 1 tiles (_rows) for T < NT, else
    NR x NT tiles (_blocks; ``wide``: see there)."""
    if xq.shape[0] < NT:
        _rows(fmt, path, nr, w, xq, xd, xa, out)
    else:
        _blocks(fmt, path, nr, True, w, xq, xd, xa, out, wide)


@njit(cache=True, inline="always")
def _panels_first(fmt, path, w, xq, xd, xa, out):
    """The tiles with one weight row per lane (AVX-512 VNNI: GEMV-path Q8_0 / Q5_0 / Q4_0 /
    IQ4_NL / MXFP4, Q4_K GEMV / GEMM, Q6_K TILED): 16-row panels for T >= 2
    (kernels_cpu.matmul_panel), 8 x 1 rows tiles R // 8 apart for decode and for R < 16
    (kernels_cpu.matmul_rows). Bit-identical either way."""
    if xq.shape[0] >= 2 and w.shape[0] >= PANEL_ROWS:
        _panels(fmt, path, w, xq, xd, xa, out)
    else:
        _tiled(fmt, path, NR_ROWS, w, xq, xd, xa, out, NT_WIDE)


@njit(cache=True, inline="always")
def _tiles_only(fmt, path, w, xq, xd, xa, out):
    """NR_ROWS x NT tiles (CPUs without AVX-512 VNNI)."""
    _tiled(fmt, path, NR_ROWS, w, xq, xd, xa, out, NT_WIDE)


# every T through the tiles with one weight row per lane (xa: as qdot_tile's, or for 32-value
# blocks -offset * each block's activation sum)
many_rows = _panels_first if HAS_VNNI else _tiles_only


@njit(cache=True, inline="always")
def _kq_tiles(fmt, path, w, xq, xd, xa, out):
    """NR_KQ x NT tiles (CPUs without AVX-512 VNNI: with AVX2 or DotProd kernels_cpu.kquant_int8's
    8-row tiles, else the generic NR-row tiles)."""
    _tiled(fmt, path, NR_KQ, w, xq, xd, xa, out, NT_WIDE)


# Q4_K GEMV / GEMM (repacked): many_rows with AVX-512 VNNI, else 8-row tiles where the CPU has
# AVX2 or DotProd (kernels_cpu.kquant_int8)
kq_rows = _panels_first if HAS_VNNI else _kq_tiles
