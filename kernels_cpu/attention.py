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
(its index modulo 16 or 64). KV cells are positions: cell j holds position j (one sequence,
unified cache, no wrap-around of llama.cpp's sliding-window cache, which is full-size for
n_ctx <= the window).
"""
import numpy as np
from numba import njit, prange

from kernels_cpu.f16 import f16_to_f32, f32_to_f16
from kernels_cpu.fmath import fma, hsum16, v_expf

_TINY_LANES = 16   # tinyBLAS<16, __m512>: KN
_VEC_STEP = 64     # GGML_F16_STEP on AVX-512 (4 x 16 lanes)


@njit(cache=True, inline="always")
def _dot_f16(a, b, ia, ib, n, tiny, lanes):
    """float32 dot product of f16 values a[ia:ia+n] (uint16 bits) and b[ib:ib+n] (float32
    holding f16 values), in tinyBLAS (tiny) or ggml_vec_dot_f16 order. ``lanes`` is a float32[64]
    scratch."""
    if tiny:
        for j in range(_TINY_LANES):
            lanes[j] = 0.0
        for l in range(0, n, _TINY_LANES):
            for j in range(_TINY_LANES):
                lanes[j] = fma(f16_to_f32(a[ia + l + j]), b[ib + l + j], lanes[j])
        return hsum16(lanes, 0)
    for j in range(_VEC_STEP):
        lanes[j] = 0.0
    n64 = n - n % _VEC_STEP
    for l in range(0, n64, _VEC_STEP):
        for j in range(_VEC_STEP):
            lanes[j] = fma(f16_to_f32(a[ia + l + j]), b[ib + l + j], lanes[j])
    for j in range(16):
        lanes[j] = (lanes[j] + lanes[j + 32]) + (lanes[j + 16] + lanes[j + 48])
    s = np.float64(hsum16(lanes, 0))
    for i in range(n64, n):
        s += np.float64(f16_to_f32(a[ia + i]) * b[ib + i])
    return np.float32(s)


@njit(cache=True, inline="always")
def _visible(p, window):
    """First cell a query at position p sees (llama.cpp LLAMA_SWA_TYPE_STANDARD: p - j < window)."""
    if window > 0 and p - window + 1 > 0:
        return p - window + 1
    return 0


@njit(cache=True)
def _scores_row(q16, kflat, kh, hd, start, end, scale, tiny, lanes, kq, probs):
    """kq[j] = K[j, kh] . q16 and probs[j] = softmax(kq * scale)[j] for cells start..end-1
    (ggml_compute_forward_soft_max_f32); other entries of probs are left unchanged.

    kflat: uint16[n_ctx, H_kv * hd] f16 bits. Softmax as ggml: x = kq * scale; max over the
    row; each 16-cell block (cells 16b .. 16b+15, masked ones contribute 0) is exponentiated
    with ggml_v_expf(x - max) and summed with _mm512_reduce_add_ps; block sums accumulate in
    float64; probabilities = e * float32(1.0 / sum).
    """
    mx = np.float32(-np.inf)
    for j in range(start, end):
        s = _dot_f16(kflat[j], q16, kh * hd, 0, hd, tiny, lanes)
        kq[j] = s
        s *= scale
        probs[j] = s
        if s > mx:
            mx = s
    total = 0.0
    for b in range(start - start % 16, end, 16):
        for i in range(16):
            j = b + i
            lanes[i] = v_expf(probs[j] - mx) if start <= j < end else np.float32(0.0)
            if start <= j < end:
                probs[j] = lanes[i]
        total += np.float64(hsum16(lanes, 0))
    inv = np.float32(1.0 / total)
    for j in range(start, end):
        probs[j] *= inv


@njit(cache=True)
def _kqv_row(probs, vflat, kh, hd_v, start, end, tiny, acc, out):
    """out[d] = sum over cells j of V[j, kh, d] * f16(probs[j]) in tinyBLAS or vec_dot lane
    order (see module docstring). acc: float32[64, hd_v] scratch."""
    nl = _TINY_LANES if tiny else _VEC_STEP
    acc[:nl, :] = 0.0
    base = kh * hd_v
    for j in range(start, end):
        p = f16_to_f32(f32_to_f16(probs[j]))
        lane = j % nl
        row = vflat[j]
        for d in range(hd_v):
            acc[lane, d] = fma(f16_to_f32(row[base + d]), p, acc[lane, d])
    if not tiny:
        for j in range(16):
            for d in range(hd_v):
                acc[j, d] = (acc[j, d] + acc[j + 32, d]) + (acc[j + 16, d] + acc[j + 48, d])
    lanes = np.empty(16, np.float32)
    for d in range(hd_v):
        for j in range(16):
            lanes[j] = acc[j, d]
        out[d] = hsum16(lanes, 0)


@njit(cache=True, inline="always")
def _paths(T, hd, hd_v):
    """(tinyBLAS for KQ, tinyBLAS for KQV): llamafile_sgemm takes n >= 2 rows when the dot length
    is a multiple of 16 and the output rows (cells for KQ, hd_v for KQV) a multiple of 4."""
    return T >= 2 and hd % _TINY_LANES == 0, T >= 2 and hd_v % 4 == 0


@njit(parallel=True, cache=True)
def attention_f16(q, k_cache, v_cache, positions, window, scale, out):
    """Multi-head causal attention with GQA, bit-exact with llama.cpp's non-flash CPU path.

    Shapes: q f32[T, H, hd] (already multiplied by any query scale the model applies, e.g.
    Gemma's f_attention_scale); k_cache uint16[n_ctx, H_kv, hd] and v_cache
    uint16[n_ctx, H_kv, hd_v] (f16 bits, cell j = position j, holding this chunk's K/V
    already); positions int32[T]; out f32[T, H, hd_v]. ``scale`` (float32) multiplies the
    scores before the softmax (ggml_soft_max_ext's scale; 1.0 for Gemma). Query head h reads
    KV head h // (H / H_kv). A query at position p sees cells j <= p, and with ``window`` > 0
    only j > p - window. The T rows pick the kernel lanes as llama.cpp does for a batch of T
    tokens (module docstring).
    """
    T, H, hd = q.shape
    H_kv = k_cache.shape[1]
    hd_v = v_cache.shape[2]
    group = H // H_kv
    kflat = k_cache.reshape(k_cache.shape[0], -1)
    vflat = v_cache.reshape(v_cache.shape[0], -1)
    tiny_kq, tiny_kqv = _paths(T, hd, hd_v)
    for th in prange(T * H):
        t = th // H
        h = th % H
        kh = h // group
        p = positions[t]
        start = _visible(p, window)
        q16 = np.empty(hd, np.float32)
        for i in range(hd):
            q16[i] = f16_to_f32(f32_to_f16(q[t, h, i]))
        lanes = np.empty(_VEC_STEP, np.float32)
        kq = np.empty(p + 1, np.float32)
        probs = np.empty(p + 1, np.float32)
        _scores_row(q16, kflat, kh, hd, start, p + 1, scale, tiny_kq, lanes, kq, probs)
        acc = np.empty((_VEC_STEP, hd_v), np.float32)
        _kqv_row(probs, vflat, kh, hd_v, start, p + 1, tiny_kqv, acc, out[t, h])


@njit(parallel=True, cache=True)
def attention_scores(q, k_cache, positions, window, scale, kq_out, probs_out):
    """The KQ product and the softmax of :func:`attention_f16` (llama.cpp's ``kq-L`` and
    ``kq_soft_max-L`` tensors, here [T, H, n] instead of ggml's [H, T, n_kv]); a testing and
    inspection aid.

    Shapes: q f32[T, H, hd]; k_cache uint16[n_ctx, H_kv, hd]; kq_out, probs_out f32[T, H, n]
    with n > max(positions). Cells a query cannot see get kq_out = 0 (llama.cpp computes a
    value there that the mask then discards) and probs_out = 0.
    """
    T, H, hd = q.shape
    H_kv = k_cache.shape[1]
    group = H // H_kv
    kflat = k_cache.reshape(k_cache.shape[0], -1)
    tiny_kq = _paths(T, hd, 4)[0]
    for th in prange(T * H):
        t = th // H
        h = th % H
        p = positions[t]
        q16 = np.empty(hd, np.float32)
        for i in range(hd):
            q16[i] = f16_to_f32(f32_to_f16(q[t, h, i]))
        lanes = np.empty(_VEC_STEP, np.float32)
        kq_out[t, h, :] = 0.0
        probs_out[t, h, :] = 0.0
        _scores_row(q16, kflat, h // group, hd, _visible(p, window), p + 1, scale, tiny_kq, lanes,
                    kq_out[t, h], probs_out[t, h])
