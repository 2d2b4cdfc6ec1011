"""Causal attention over a paged KV cache of f16, f32 or q8_0 rows, computed exactly as
llama.cpp's CPU backend does it without flash attention (llm_graph_context::build_attn_mha,
flash_attn = false). For an f16 cache:

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

f32 and q8_0 pools take the same walk with their own row arithmetic (kernels_cpu.kv_rows: f32
K in 16 float32 lanes; q8_0 K times the query quantized to Q8_0, block by block, as
ggml_vec_dot_q8_0_q8_0; q8_0 V dequantized times the probability).

f16 pools (the default cache) take tiles instead of that walk of one (row, head) pair at a
time: runs of rows of one sequence x one KV head with all its query heads, each K and V row
converted once for all of them (kernels_cpu.attention_tiles; same results bit for bit, the walk
being the reference in tests/test_attention_tiles.py).
"""
import math
import threading
from functools import lru_cache

import numpy as np
import numba
from numba import literally, njit, prange

from kernels_cpu.attention_tiles import (_KQV_REGS, _by_lane, _f16_rounded, _kq_cells, _kqv_cells, _softmax_f16,
                                        _transposed, kqv_chunk)
from kernels_cpu.fmath import hsum16, v_expf
from kernels_cpu.kv_rows import TINY_LANES, VEC_STEP, kq_block, kqv_block, prep_query, store_row


@njit(cache=True, nogil=True)
def _kq_row(qv, pool, table, base, n, hd, start, end, tiny, kq):
    """kq[j] = K[j] . q for cells start..end-1 (kernels_cpu.kv_rows._kdot gives the lane orders). K rows of n
    pool elements through the block table: pool[table[j // bs], j % bs, base:base+n]
    (walked block by block, no division per cell)."""
    bs = pool.shape[1]
    for b in range(start // bs, (end + bs - 1) // bs):
        first = b * bs
        j0 = max(start, first)
        kq_block(qv, pool[table[b]], base, n, hd, j0 - first, min(end, first + bs) - first, tiny, kq, j0)


@njit(cache=True, nogil=True)
def _softmax_row(kq, start, end, scale, softcap, block, probs):
    """probs[j] for cells start..end-1 = ggml_compute_forward_soft_max_f32 of the row kq with
    every other cell masked to -inf: x = kq * scale; m = max x; e = ggml_v_expf(x - m); each
    16-cell block (cells 16b..16b+15; masked cells count 0) summed with _mm512_reduce_add_ps,
    block sums accumulated in float64 in order; probs = e * float32(1.0 / sum). With
    ``softcap`` > 0 (float32) the scores are soft-capped first, in place in kq (llama.cpp's
    attn_soft_cap: ggml_scale by 1.0f/softcap, ggml_tanh with tanhf, ggml_scale by softcap).
    block: float32[16] scratch. Other entries of probs are left unchanged."""
    mx = np.float32(-np.inf)
    if softcap > 0:
        inv = np.float32(1.0) / softcap
        for j in range(start, end):
            kq[j] = np.float32(math.tanh(kq[j] * inv)) * softcap
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
    lanes = TINY_LANES if tiny else VEC_STEP
    acc[:lanes, :] = 0.0
    bs = pool.shape[1]
    for b in range(start // bs, (end + bs - 1) // bs):
        first = b * bs
        j0 = max(start, first)
        kqv_block(acc[:lanes], pool[table[b]], base, n, hd_v, probs, j0 - first, min(end, first + bs) - first, j0)
    if not tiny:
        for j in range(16):
            for d in range(hd_v):
                acc[j, d] = (acc[j, d] + acc[j + 32, d]) + (acc[j + 16, d] + acc[j + 48, d])
    for d in range(hd_v):
        out[d] = _hsum16_column(acc, d)


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
    return multi and hd % TINY_LANES == 0, multi and hd_v % 4 == 0


@njit(cache=True, nogil=True)
def _attention_rows(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, softcap, out, first, step,
                    tiny_kq, tiny_kqv):
    """paged_attention for the (row, head) pairs first, first + step, ... (pair th = row th // H,
    head th % H), with the lane orders of _paths."""
    T, H, hd = q.shape
    n_blocks, bs, H_kv = k_pool.shape[0], k_pool.shape[1], k_pool.shape[2]
    hd_v = out.shape[2]
    nk, nv = k_pool.shape[3], v_pool.shape[3]  # pool elements per head row
    group = H // H_kv
    kflat = k_pool.reshape(n_blocks, bs, -1)
    vflat = v_pool.reshape(n_blocks, bs, -1)
    block = np.empty(16, np.float32)
    acc = np.empty((VEC_STEP, hd_v), np.float32)
    for th in range(first, T * H, step):
        t = th // H
        h = th % H
        kh = h // group
        table = tables[seq_ids[t]]
        p = positions[t]
        start = _visible(p, window)
        row = np.empty(p + 1, np.float32)
        _kq_row(prep_query(q, t, h, k_pool), kflat, table, kh * nk, nk, hd, start, p + 1, tiny_kq, row)
        _softmax_row(row, start, p + 1, scale, softcap, block, row)
        _kqv_row(row, vflat, table, kh * nv, nv, hd_v, start, p + 1, tiny_kqv, acc, out[t, h])


@njit(parallel=True, cache=True, nogil=True)
def _attention_par(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, softcap, out, tiny_kq, tiny_kqv):
    # interleaved pairs: numba splits a prange into contiguous ranges, and causal rows grow
    n_chunks = min(q.shape[0] * q.shape[1], 64)
    for c in prange(n_chunks):
        _attention_rows(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, softcap, out, c, n_chunks,
                        tiny_kq, tiny_kqv)


# Tiles (kernels_cpu.attention_tiles): up to TILE_ROWS rows of one sequence share the
# transposed K and V of the cells they see; their scores and probabilities are made for
# STEP_QUERIES queries (rows x query heads of a KV head) at a time.
TILE_ROWS = 64
STEP_QUERIES = 28


@njit(cache=True, nogil=True)
def _tiles(seq_ids, positions, rows):
    """(first row, number of rows) int64[n] of the tiles: runs of up to ``rows`` batch rows of one
    sequence at consecutive positions."""
    T = positions.shape[0]
    first = np.empty(T, np.int64)
    count = np.empty(T, np.int64)
    n = 0
    t = 0
    while t < T:
        e = t + 1
        while e < T and e - t < rows and seq_ids[e] == seq_ids[t] and positions[e] == positions[e - 1] + 1:
            e += 1
        first[n] = t
        count[n] = e - t
        n += 1
        t = e
    return first[:n], count[:n]


@njit(cache=True, nogil=True)
def _cell_slots(table, bs, lo, hi, slots):
    """slots[c] = pool slot (block * bs + offset) of cell lo - lo % 16 + c, for the cells of the
    16-cell blocks holding lo..hi-1; cells outside lo..hi-1 get the slot of the nearest one
    (their scores are never used, and never is their V)."""
    first = lo - lo % 16
    for c in range(first, lo):
        slots[c - first] = table[lo // bs] * bs + lo % bs
    j = lo
    while j < hi:
        base = table[j // bs] * bs - (j // bs) * bs
        end = min(hi, (j // bs + 1) * bs)
        for c in range(j, end):
            slots[c - first] = base + c
        j = end
    for c in range(hi, (hi + 15) // 16 * 16):
        slots[c - first] = table[(hi - 1) // bs] * bs + (hi - 1) % bs


@njit(cache=True, nogil=True)
def _attend_tile(q, kflat, vflat, table, bs, H_kv, kh, t0, n, p0, window, scale, softcap, out, hd, hd_v, lanes,
                 chunk, slots, kt, vl, qf, kq, pl, w):
    """paged_attention's output for the rows t0..t0+n-1 (one sequence, positions p0..p0+n-1)
    and the query heads of KV head kh, from f16 pools (kflat, vflat: the pools flattened;
    table: the sequence's block table), in ``lanes`` (16: tinyBLAS, 64: ggml_vec_dot_f16)
    (literal, as hd and hd_v); chunk: kqv_chunk(hd_v, lanes). slots, kt, vl, qf, kq, pl, w:
    scratch (kernels_cpu.attention_tiles)."""
    hd, hd_v, lanes = literally(hd), literally(hd_v), literally(lanes)
    H = q.shape[1]
    G = H // H_kv
    lo = _visible(p0, window)
    lo_a = lo - lo % 16
    nblk = (p0 + n - lo_a + 15) // 16
    ld = nblk * 16 + 256            # scores of a query (_softmax_f16 reads up to 256 cells past its last)
    nb = nblk + 16                  # probabilities of a query: 16 lanes of nb
    _cell_slots(table, bs, lo, p0 + n, slots)
    _transposed(kflat, slots, nblk, H_kv * hd, kh * hd, hd, kt)
    _by_lane(vflat, slots, nblk, H_kv * hd_v, kh * hd_v, hd_v, chunk, vl)
    qflat = q.reshape(-1)
    oflat = out.reshape(-1)
    step = max(1, STEP_QUERIES // G)
    for s0 in range(0, n, step):
        m = min(step, n - s0)
        for r in range(m):
            _f16_rounded(qflat, ((t0 + s0 + r) * H + kh * G) * hd, qf, r * G * hd, G * hd)
        first = (_visible(p0 + s0, window) - lo_a) // 16
        _kq_cells(kt, first, (p0 + s0 + m - lo_a + 15) // 16, qf, m * G, kq, ld, hd, lanes)
        for r in range(m):
            p = p0 + s0 + r
            start = _visible(p, window)
            for g in range(G):
                o = (r * G + g) * ld
                if softcap > 0:
                    inv = np.float32(1.0) / softcap
                    for j in range(o + start - lo_a, o + p + 1 - lo_a):
                        kq[j] = np.float32(math.tanh(kq[j] * inv)) * softcap
                _softmax_f16(kq, o, start - lo_a, p + 1 - lo_a, scale, pl, (r * G + g) * 16 * nb, nb)
            _kqv_cells(vl, nblk, pl, nb, r * G, G, lo_a, start, p + 1, oflat, ((t0 + s0 + r) * H + kh * G) * hd_v, w,
                       hd_v, lanes)


@njit(cache=True, nogil=True)
def _plan(seq_ids, positions, window, H_kv, threads):
    """The units of the tiled path, tile x KV head, shared out among up to ``threads`` workers:
    (first, count) of the tiles (_tiles); (order, share): worker k takes the units
    order[share[k]:share[k + 1]] (unit u: tile u // H_kv, KV head u % H_kv); max_cells: the
    most cells (16-cell blocks) a tile sees. Units go, the costliest first, to the worker with
    the least cost so far (a unit's cost: the cells its rows see): numba's prange splits its
    range in contiguous parts, and causal tiles grow with the position."""
    first, count = _tiles(seq_ids, positions, TILE_ROWS)
    n_units = first.shape[0] * H_kv
    n_workers = min(n_units, threads)
    max_cells = 0
    cost = np.empty(first.shape[0])
    for i in range(first.shape[0]):
        p0 = positions[first[i]]
        lo = _visible(p0, window)
        max_cells = max(max_cells, p0 + count[i] - (lo - lo % 16))
        cells = 0
        for t in range(first[i], first[i] + count[i]):
            cells += positions[t] + 1 - _visible(positions[t], window)
        cost[i] = cells + 64 * count[i]
    # tiles by cost, largest first (insertion sort: few tiles, and mostly in order already)
    by_cost = np.arange(first.shape[0])
    for i in range(1, by_cost.shape[0]):
        x = by_cost[i]
        j = i
        while j > 0 and cost[by_cost[j - 1]] < cost[x]:
            by_cost[j] = by_cost[j - 1]
            j -= 1
        by_cost[j] = x
    load = np.zeros(n_workers)
    worker = np.empty(n_units, np.int64)
    for i in by_cost:
        for kh in range(H_kv):
            k = 0
            for w in range(1, n_workers):
                if load[w] < load[k]:
                    k = w
            worker[i * H_kv + kh] = k
            load[k] += cost[i]
    share = np.zeros(n_workers + 1, np.int64)
    for u in range(n_units):
        share[worker[u] + 1] += 1
    for k in range(n_workers):
        share[k + 1] += share[k]
    order = np.empty(n_units, np.int64)
    filled = share[:-1].copy()
    for u in range(n_units):
        order[filled[worker[u]]] = u
        filled[worker[u]] += 1
    return first, count, order, share, (max_cells + 15) // 16 * 16


def _scratch_floats(max_cells, G, hd, hd_v):
    """Floats of one worker's scratch in _run_share for tiles of up to max_cells cells."""
    step = max(1, STEP_QUERIES // G)
    return max_cells * (hd + hd_v) + step * G * hd + 2 * step * G * (max_cells + 256) + _KQV_REGS * 256


_SCRATCH = threading.local()


def _tile_scratch(n_workers: int, max_cells: int, G: int, hd: int, hd_v: int):
    """(float32[n_workers, F], int64[n_workers, max_cells]): the tiled path's scratch, kept per
    calling thread and grown (x1.5) when too small, so a decode step does not allocate, and
    page-fault in, megabytes of fresh buffers per layer (a 4k-token context of head size 128:
    2 x 1.9 MB per worker, which made a decode step's attention several times slower)."""
    return (_kept("f", n_workers, _scratch_floats(max_cells, G, hd, hd_v), np.float32),
            _kept("i", n_workers, max_cells, np.int64))


def _kept(name: str, rows: int, cols: int, dtype):
    """This thread's scratch array ``name`` of at least [rows, cols], grown (x1.5) when smaller."""
    a = getattr(_SCRATCH, name, None)
    if a is None or a.shape[0] < rows or a.shape[1] < cols:
        old_rows, old_cols = (0, 0) if a is None else a.shape
        a = np.empty((max(rows, old_rows), max(cols, int(old_cols * 1.5))), dtype)
        setattr(_SCRATCH, name, a)
    return a


@njit(cache=True, nogil=True)
def _run_share(q, kflat, vflat, tables, seq_ids, positions, window, scale, softcap, out, H_kv, bs, hd, hd_v, lanes,
               chunk, first, count, units, max_cells, scratch, slots):
    """_attend_tile for the units ``units`` (of _plan) in turn, in one worker's scratch (float32
    of at least _scratch_floats(max_cells, ...) values; slots int64[>= max_cells])."""
    hd, hd_v, lanes = literally(hd), literally(hd_v), literally(lanes)
    G = q.shape[1] // H_kv
    step = max(1, STEP_QUERIES // G)
    at = 0
    kt = scratch[at : at + max_cells * hd]
    at += max_cells * hd
    vl = scratch[at : at + max_cells * hd_v]
    at += max_cells * hd_v
    qf = scratch[at : at + step * G * hd]
    at += step * G * hd
    kq = scratch[at : at + step * G * (max_cells + 256)]
    at += step * G * (max_cells + 256)
    pl = scratch[at : at + step * G * (max_cells + 256)]
    at += step * G * (max_cells + 256)
    w = scratch[at : at + _KQV_REGS * 256]
    for u in units:
        i = u // H_kv
        t0 = first[i]
        _attend_tile(q, kflat, vflat, tables[seq_ids[t0]], bs, H_kv, u % H_kv, t0, count[i], positions[t0], window,
                     scale, softcap, out, hd, hd_v, lanes, chunk, slots, kt, vl, qf, kq, pl, w)


@lru_cache(maxsize=None)
def _tiled_kernel(hd, hd_v, lanes):
    """The parallel kernel ``(q, k_pool, v_pool, tables, seq_ids, positions, window, scale,
    softcap, out, threads)`` of paged_attention for f16 pools by tiles of rows (_tiles) x KV
    heads, for the head sizes hd, hd_v and ``lanes`` (16: tinyBLAS, 64: ggml_vec_dot_f16) as
    compile-time constants (numba caches each on disk apart: its key holds the closure's
    values): the units shared out among ``threads`` workers (_plan), a prange iteration each.
    (No serial build for small work: a decode step at 32 cells took as long on 2 threads.)"""
    chunk = kqv_chunk(hd_v, lanes)

    def kernel(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, softcap, out, threads, scratch, slots):
        bs, H_kv = k_pool.shape[1], k_pool.shape[2]
        first, count, order, share, max_cells = _plan(seq_ids, positions, window, H_kv, threads)
        kflat = k_pool.reshape(-1)
        vflat = v_pool.reshape(-1)
        for k in prange(share.shape[0] - 1):
            _run_share(q, kflat, vflat, tables, seq_ids, positions, window, scale, softcap, out, H_kv, bs, hd, hd_v,
                       lanes, chunk, first, count, order[share[k]:share[k + 1]], max_cells, scratch[k], slots[k])

    kernel.__name__ = kernel.__qualname__ = f"_attention_tiled_{hd}_{hd_v}_{lanes}"
    return njit(parallel=True, cache=True, nogil=True)(kernel)


# Below this many multiply-adds (rows x heads x visible cells x head_dim) the per-pair walk runs
# on the calling thread: waking the worker threads costs more (a decode step at a short context).
PARALLEL_MIN_MACS = 1 << 18
# f16 pools take the tiles when a tile would have this many queries (rows of a sequence in the
# batch x query heads per KV head): the K and V rows it converts serve them all. Fewer (a decode
# step of a model with 4 query heads per KV head: each row converted for 4 queries, to float32
# and twice the bytes) are faster in the per-pair walk, which reads the f16 rows as they are.
TILE_MIN_QUERIES = 6


def paged_attention(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, out, batch_invariant=False,
                    softcap=0.0):
    """Multi-head causal attention with GQA over a paged KV cache (f16, f32 or q8_0 pools),
    bit-exact with llama.cpp's non-flash CPU path.

    Shapes: q f32[T, H, hd] (already multiplied by any query scale the model applies, e.g.
    Gemma's f_attention_scale); k_pool [n_blocks, bs, H_kv, row] and v_pool
    [n_blocks, bs, H_kv, row_v] in the pool type (uint16 f16 bits or float32, row = hd; uint8
    q8_0, row = hd / 32 * 34), holding this chunk's K/V already (:func:`store_kv`); tables
    int32[S, max_blocks]: position j of sequence s is in block tables[s, j // bs], slot
    j % bs (a contiguous cache is one block of n_ctx per sequence); seq_ids and positions
    int32[T] (row t is the query of sequence seq_ids[t] at positions[t]); out f32[T, H, hd_v].
    ``scale`` (float32) multiplies the scores before the softmax (ggml_soft_max_ext's scale;
    1.0 for Gemma); ``softcap`` > 0 soft-caps the raw scores before that, kq = softcap *
    tanh(kq / softcap) (Gemma 2's attn_logit_softcapping; 0, the default: not). Query head h
    reads KV head h // (H / H_kv). A query at position p sees
    the cells j <= p of its own sequence, and with ``window`` > 0 only j > p - window (blocks
    wholly before that may be holes). The T rows pick the kernel lanes as llama.cpp does for a
    batch of T tokens (module docstring), or with ``batch_invariant`` each as a batch of one
    (so a row's result does not depend on the other rows). Callers check the tables; a wrong
    block id is an out-of-bounds read.
    """
    T, H, hd = q.shape
    if k_pool.ndim != 4 or v_pool.shape[:3] != k_pool.shape[:3] or H % k_pool.shape[2] or out.shape[:2] != (T, H) \
            or seq_ids.shape != (T,) or positions.shape != (T,):
        raise ValueError(f"paged_attention: q {q.shape}, pools {k_pool.shape} / {v_pool.shape}, out {out.shape} "
                         "do not fit")
    tiny_kq, tiny_kqv = _paths(T, hd, out.shape[2], batch_invariant)
    cells = int(positions.max()) + 1 if window <= 0 else min(int(positions.max()) + 1, window)
    softcap = np.float32(softcap)
    hd_v = out.shape[2]
    rows_per_seq = 1 if T == 1 else T / len(np.unique(seq_ids))
    if (k_pool.dtype == np.uint16 and v_pool.dtype == np.uint16 and hd % 16 == 0 and (tiny_kq or hd % 64 == 0)
            and hd_v % 16 == 0 and rows_per_seq * (H // k_pool.shape[2]) >= TILE_MIN_QUERIES
            and all(a.flags.c_contiguous for a in (q, k_pool, v_pool, out))):
        threads = numba.get_num_threads()
        bound = (int(positions.max()) + 1 + 31) // 16 * 16      # >= any tile's cells (_plan's max_cells)
        scratch, slots = _tile_scratch(threads, bound, H // k_pool.shape[2], hd, hd_v)
        _tiled_kernel(hd, hd_v, 16 if tiny_kq else 64)(q, k_pool, v_pool, tables, seq_ids, positions, window, scale,
                                                       softcap, out, threads, scratch, slots)
        return
    if T * H * cells * hd >= PARALLEL_MIN_MACS:
        _attention_par(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, softcap, out, tiny_kq, tiny_kqv)
    else:
        _attention_rows(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, softcap, out, 0, 1,
                        tiny_kq, tiny_kqv)


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
        store_row(flat[tables[seq_ids[t], p // bs], p % bs], src[t])


@njit(parallel=True, cache=True, nogil=True)
def attention_scores(q, k_cache, positions, window, scale, kq_out, probs_out):
    """The KQ product and the softmax of :func:`paged_attention` (llama.cpp's ``kq-L`` and
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
        _kq_row(prep_query(q, t, h, k_cache), kflat, table, (h // group) * hd, hd, hd, start, p + 1, tiny_kq,
                kq_out[t, h])
        _softmax_row(kq_out[t, h], start, p + 1, scale, np.float32(0.0), np.empty(16, np.float32), probs_out[t, h])
