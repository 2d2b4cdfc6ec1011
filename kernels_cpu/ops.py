"""Element-wise kernels of the transformer forward pass (attention: kernels_cpu/attention.py).

Each kernel reproduces the ggml CPU operator named in its docstring bit for bit, as built for
x86 with AVX-512 (the llama.cpp build behind the goldens; tests/test_llama_ops.py holds them to
llama.cpp's own tensors). All write into preallocated outputs (``out`` may alias the input
where noted) and take float32 C-contiguous arrays unless stated otherwise.
"""
import math

import numba
import numpy as np
from numba import njit, prange

from kernels_cpu.f16 import f16_to_f32, f32_to_f16
from kernels_cpu.fmath import fma, hsum16, v_expf

# Below this many elements a kernel runs on the calling thread: waking numba's worker threads
# for a decode-sized row costs more than the row (a few microseconds on an idle machine, far
# more when the cores are busy). Results do not depend on the choice.
PARALLEL_MIN = 1 << 15

_SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)  # ggml's SQRT_2_OVER_PI
_GELU_COEF_A = np.float32(0.044715)


@njit(cache=True, nogil=True, error_model="numpy")   # IEEE division as ggml: 1/0 = inf, no exception
def _rms_norm_rows(x, weight, eps, out, r0, r1):
    n = x.shape[1]
    for t in range(r0, r1):
        s = 0.0
        for i in range(n):
            v = x[t, i]
            s += np.float64(v * v)
        scale = np.float32(1.0) / np.sqrt(np.float32(s / n) + np.float32(eps))
        for i in range(n):
            out[t, i] = (x[t, i] * scale) * weight[i]


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _rms_norm_par(x, weight, eps, out):
    for t in prange(x.shape[0]):
        _rms_norm_rows(x, weight, eps, out, t, t + 1)


def rms_norm(x, weight, eps, out):
    """RMSNorm over the last axis, then scale by ``weight`` (ggml_rms_norm + ggml_mul).

    Shapes: x f32[T, n], weight f32[n], out f32[T, n] (may alias x). As in ggml, each square
    is rounded to float32 and summed in order in float64 (ggml_float); mean = float32(sum / n);
    scale = 1 / sqrt(mean + eps) in float32; y = (x * scale) * weight. Rows of a 3-D x[T, H, hd]
    viewed as [T*H, hd] give Gemma 3's per-head q/k norms (ggml_rms_norm on [hd, H, T]).
    """
    if x.ndim != 2 or weight.shape != (x.shape[1],) or out.shape != x.shape:
        raise ValueError(f"rms_norm: x {x.shape}, weight {weight.shape}, out {out.shape} do not fit")
    if x.size >= PARALLEL_MIN:
        _rms_norm_par(x, weight, eps, out)
    else:
        _rms_norm_rows(x, weight, eps, out, 0, x.shape[0])


def rms_norm_heads(x, weight, eps):
    """In-place RMSNorm of every head vector (Gemma 3's q/k norms, ggml_rms_norm on [hd, H, T]).

    Shapes: x f32[T, H, hd] (C-contiguous), weight f32[hd].
    """
    flat = x.reshape(-1, x.shape[-1])
    rms_norm(flat, weight, eps, flat)


def rope_cos_sin(positions, n_rot, freq_base, freq_scale=1.0, freq_factors=None):
    """cos/sin tables for RoPE exactly as ggml_rope_cache_init (ggml-cpu ops.cpp, no YaRN).

    positions int[T] -> (cos, sin) float32[T, n_rot/2]. In float32, as ggml: theta_scale =
    powf(freq_base, -2.0f / n_rot); theta = (float)p, multiplied by theta_scale after each
    pair; entry i = cosf/sinf(freq_scale * (theta / freq_factors[i])). cosf/sinf/powf are the C
    library's, as in ggml. ``freq_factors`` (llama 3's ``rope_freqs`` tensor) is float32[n_rot/2].
    """
    if n_rot < 2 or n_rot % 2:
        raise ValueError(f"rope_cos_sin: n_rot must be even and at least 2, got {n_rot}")
    ff = np.ones(n_rot // 2, np.float32) if freq_factors is None else np.asarray(freq_factors, np.float32)
    if ff.shape != (n_rot // 2,):
        raise ValueError(f"rope_cos_sin: freq_factors has shape {ff.shape}, expected ({n_rot // 2},)")
    pos = np.asarray(positions, dtype=np.int64)
    cos = np.empty((len(pos), n_rot // 2), np.float32)
    sin = np.empty_like(cos)
    _rope_cache(pos, np.float32(freq_base), np.float32(freq_scale), ff, cos, sin)
    return cos, sin


@njit(cache=True, nogil=True, error_model="numpy")   # a 0 in freq_factors: inf as in ggml, no exception
def _rope_cache(positions, freq_base, freq_scale, freq_factors, cos, sin):
    half = cos.shape[1]
    theta_scale = freq_base ** (np.float32(-2.0) / np.float32(2 * half))
    for t in range(positions.shape[0]):
        theta = np.float32(positions[t])
        for i in range(half):
            th = freq_scale * (theta / freq_factors[i])
            cos[t, i] = math.cos(th)
            sin[t, i] = math.sin(th)
            theta *= theta_scale


@njit(cache=True, nogil=True)
def _rope_rows(x, cos, sin, neox, r0, r1):
    H = x.shape[1]
    half = cos.shape[1]
    for th in range(r0, r1):
        t = th // H
        h = th % H
        for i in range(half):
            c = cos[t, i]
            s = sin[t, i]
            i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
            a = x[t, h, i0]
            b = x[t, h, i1]
            x[t, h, i0] = fma(a, c, -(b * s))
            x[t, h, i1] = fma(a, s, b * c)


@njit(parallel=True, cache=True, nogil=True)
def _rope_par(x, cos, sin, neox):
    for th in prange(x.shape[0] * x.shape[1]):
        _rope_rows(x, cos, sin, neox, th, th + 1)


def rope(x, cos, sin, neox):
    """Rotary position embedding in place (ggml_rope_ext, modes NORM and NEOX), bit-exact.

    Shapes: x f32[T, H, hd], cos/sin f32[T, n_rot/2] (from :func:`rope_cos_sin`) with
    n_rot <= hd (the first n_rot dimensions rotate, the rest pass through). NEOX pairs
    dimension i with i + n_rot/2 (GPT-NeoX, Qwen2, Gemma); NORM pairs 2i with 2i+1 (LLaMA).
    ggml's rotate_pairs computes x0*c - x1*s and x0*s + x1*c, which GCC contracts to
    fma(x0, c, -(x1*s)) and fma(x0, s, x1*c).
    """
    if x.ndim != 3 or cos.ndim != 2 or sin.shape != cos.shape or cos.shape[0] != x.shape[0] \
            or 2 * cos.shape[1] > x.shape[2]:
        raise ValueError(f"rope: cos/sin {cos.shape} do not fit x {x.shape} (n_rot/2 pairs of at most head_dim)")
    if x.size >= PARALLEL_MIN:
        _rope_par(x, cos, sin, neox)
    else:
        _rope_rows(x, cos, sin, neox, 0, x.shape[0] * x.shape[1])


@njit(cache=True, nogil=True, inline="always")
def _silu_mul_cols(gate, up, out, t, c0, c1):
    """Row t, columns [c0, c1) (c0 a multiple of 16) of silu_mul: ggml_v_silu below n_ff - n_ff % 16,
    ggml_silu_f32 from there. Inlined into the parallel loop, where LLVM vectorizes v_expf (3x
    faster than a called function): a branch-free loop over slices whose output (tmp) cannot
    overlap its inputs (callers pass out = gate)."""
    n = gate.shape[1]
    n16 = n - n % 16
    m = max(c0, min(c1, n16))
    gs = gate[t][c0:m]
    us = up[t][c0:m]
    tmp = np.empty(m - c0, np.float32)
    for j in range(m - c0):
        x = gs[j]
        tmp[j] = (x / (np.float32(1.0) + v_expf(np.float32(0.0) - x))) * us[j]
    out[t][c0:m] = tmp
    for i in range(m, c1):
        x = gate[t, i]
        out[t, i] = (x / (np.float32(1.0) + np.float32(math.exp(-x)))) * up[t, i]


# silu_mul splits a row among the threads when there are fewer rows than threads (a decode
# step: 8960 values 9.8 -> 5.0 us on 2 threads), in parts of at least this many values
SILU_MIN_COLS = 1024


@njit(parallel=True, cache=True, nogil=True)
def _silu_mul_par(gate, up, out, threads):
    T, n = gate.shape
    parts = max(1, min(threads // T, n // SILU_MIN_COLS))
    step = ((n + parts - 1) // parts + 15) // 16 * 16
    for i in prange(T * parts):
        t = i // parts
        c0 = i % parts * step
        c1 = min(n, c0 + step)
        if c0 < c1:
            _silu_mul_cols(gate, up, out, t, c0, c1)


def silu_mul(gate, up, out):
    """out = silu(gate) * up, bit-exact with ggml_vec_swiglu_f32 (ggml_swiglu_split; LLM_FFN_SILU
    + LLM_FFN_PAR). Shapes f32[T, n_ff]; out may alias gate.

    As ggml's AVX-512 build: each row in blocks of 16 takes ggml_v_silu, x / (1 + v_expf(-x))
    (:func:`kernels_cpu.fmath.v_expf`); the last n_ff % 16 elements take ggml_silu_f32,
    x / (1 + expf(-x)) with the C library's expf.
    """
    _silu_mul_par(gate, up, out, numba.get_num_threads())   # also for one row: v_expf vectorizes there


@njit(cache=True, nogil=True)
def _gelu_table():
    """ggml_table_gelu_f16: f16 bits -> f16 bits of ggml_gelu_f32, the tanh approximation
    0.5x(1 + tanhf(sqrt(2/pi) x (1 + 0.044715 x^2))) with GCC's contraction of 1 + (a x) x
    into one FMA and glibc's tanhf; NaNs become the quiet NaN of their sign, as F16C rounds."""
    table = np.empty(1 << 16, np.uint16)
    for i in range(1 << 16):
        x = f16_to_f32(np.uint16(i))
        if x != x:
            table[i] = np.uint16(0x7E00 | (i & 0x8000))
            continue
        if x == -np.inf:          # -inf * 0 is the CPU's default NaN: negative on x86 (ggml's table), positive
            table[i] = np.uint16(0xFE00)      # on arm64; the x86 bits on every CPU
            continue
        inner = fma(_GELU_COEF_A * x, x, np.float32(1.0))
        table[i] = f32_to_f16(np.float32(0.5) * x * (np.float32(1.0) + math.tanh(_SQRT_2_OVER_PI * x * inner)))
    return table


GELU_TABLE = _gelu_table()


@njit(cache=True, nogil=True)
def _gelu_mul_rows(gate, up, out, table, r0, r1):
    n = gate.shape[1]
    for t in range(r0, r1):
        for i in range(n):
            g = gate[t, i]
            if g <= np.float32(-10.0):
                out[t, i] = np.float32(0.0)
            elif g >= np.float32(10.0):
                out[t, i] = g * up[t, i]
            else:
                out[t, i] = f16_to_f32(table[f32_to_f16(g)]) * up[t, i]


@njit(parallel=True, cache=True, nogil=True)
def _gelu_mul_par(gate, up, out, table):
    for t in prange(gate.shape[0]):
        _gelu_mul_rows(gate, up, out, table, t, t + 1)


def gelu_mul(gate, up, out):
    """out = gelu(gate) * up, bit-exact with ggml_vec_geglu_f32 (ggml_geglu_split; LLM_FFN_GELU
    + LLM_FFN_PAR) in ggml's CPU build (GGML_GELU_FP16). Shapes f32[T, n_ff]; out may alias gate.

    x <= -10 gives 0, x >= 10 gives x * up; otherwise x is rounded to f16 and looked up in
    :data:`GELU_TABLE` (ggml_table_gelu_f16, f16 results).
    """
    if gate.size >= PARALLEL_MIN:
        _gelu_mul_par(gate, up, out, GELU_TABLE)
    else:
        _gelu_mul_rows(gate, up, out, GELU_TABLE, 0, gate.shape[0])


@njit(parallel=True, cache=True, nogil=True)
def softcap(x, cap):
    """In place x = cap * tanh(x * (1/cap)) on f32[T, n] (C-contiguous; llama.cpp's final logit
    soft-capping: ggml_scale by 1.0f/cap, ggml_tanh with the C library's tanhf, ggml_scale by cap)."""
    cap = np.float32(cap)
    inv = np.float32(1.0) / cap
    flat = x.reshape(-1)
    for i in prange(flat.shape[0]):
        flat[i] = math.tanh(flat[i] * inv) * cap


@njit(cache=True, nogil=True)
def soft_max_rows(x, out):
    """Softmax of every row of x f32[T, n] into out f32[T, n] (ggml_soft_max without mask or
    scale, ggml_compute_forward_soft_max_f32 with ggml_vec_soft_max_f32, AVX-512): m = max of
    the row; each whole 16-value block e = ggml_v_expf(x - m), summed with
    _mm512_reduce_add_ps into a float64 total; the tail e = expf(x - m) (the C library's), each
    added to the total in float64; out = e * float32(1.0 / total). Returns out."""
    block = np.empty(16, np.float32)
    n = x.shape[1]
    for r in range(x.shape[0]):
        mx = np.float32(-np.inf)
        for j in range(n):
            mx = max(mx, x[r, j])
        total = 0.0
        i = 0
        while i + 15 < n:
            for j in range(16):
                block[j] = out[r, i + j] = v_expf(x[r, i + j] - mx)
            total += np.float64(hsum16(block, 0))
            i += 16
        for j in range(i, n):
            out[r, j] = math.exp(x[r, j] - mx)
            total += np.float64(out[r, j])
        inv = np.float32(1.0 / total)
        for j in range(n):
            out[r, j] *= inv
    return out


@njit(cache=True, nogil=True)
def _fwht_rows(x, r0, r1):
    """Fast Walsh-Hadamard transform of rows r0..r1-1 of x f32[R, n] in place (Sylvester
    order, butterflies of span 1, 2, 4, ...), scaled by 1/sqrt(n) at the end."""
    n = x.shape[1]
    scale = np.float32(1.0 / np.sqrt(n))
    for r in range(r0, r1):
        h = 1
        while h < n:
            for i in range(0, n, 2 * h):
                for j in range(i, i + h):
                    a = x[r, j]
                    b = x[r, j + h]
                    x[r, j] = a + b
                    x[r, j + h] = a - b
            h *= 2
        for j in range(n):
            x[r, j] *= scale


@njit(parallel=True, cache=True, nogil=True)
def _fwht_par(x):
    n_chunks = min(x.shape[0], 64)
    step = (x.shape[0] + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        _fwht_rows(x, c * step, min(x.shape[0], (c + 1) * step))


def rotate_chunks(x: np.ndarray, n: int) -> None:
    """In place x = x @ H over every run of n values (x f32, C-contiguous, size a multiple of
    n; H the orthonormal Walsh-Hadamard matrix of order n: Sylvester's construction scaled by
    1/sqrt(n), as ggml_gen_hadamard; symmetric, H @ H = I). llama.cpp rotates Q and K (and V)
    this way before a quantized KV cache, so that outliers spread over the block the quantizer
    scales (llama_mul_mat_hadamard, a matrix product there; a fast Walsh-Hadamard transform
    here, equal to rounding). Runs on numba's threads, never on a BLAS library's own (whose
    spinning threads slowed the following kernels twofold on 2 cores)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"rotate_chunks: n must be a power of two, got {n}")
    flat = x.reshape(-1, n)
    if x.size >= PARALLEL_MIN:
        _fwht_par(flat)
    else:
        _fwht_rows(flat, 0, flat.shape[0])
