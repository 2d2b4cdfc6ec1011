"""How each KV cache type stores a layer's K and V, and attention over what it stored.

The model hands :func:`store_and_attend` a layer's q, k and v, the rows' sequences and
positions, and the layer's facts (sliding window, softmax scale, the static part of its K
bias); the cache's K and V types (``cache.type_k``, ``cache.type_v``) pick a codec each, so
the model does not know which KV types exist. Adding a KV type is a row in :data:`CODECS`
(plus its row layout in edge.kv.cache and its row kernels in kernels_cpu.kv_rows).

- f16 and f32 store K and V as computed; attention equals llama.cpp's.
- q8_0 (blocks of 32 int8 with one f16 scale) loses the small variations of a row to a large
  value in its block, so before quantizing:

  * K loses the static part of the layer's K bias when the model gives one
    (edge.models.rope.static_k_bias): every key of a head drops the same vector c, every
    score q.k drops the same q.c, and softmax is unchanged (exact up to rounding). llama.cpp's
    q8_0 K cache stores K unshifted, so this is an edge deviation (it keeps Qwen2.5's biases of
    up to 210 from costing the rest of K its bits);
  * Q and K are rotated alike by a Walsh-Hadamard matrix (Q.K unchanged) of the largest power
    of two from 64 up dividing head_dim, as llama.cpp's attn_rot_k;
  * V is rotated in runs of 64 and the attention output rotated back (llama.cpp's attn_rot_v),
    when head_dim_v is a multiple of 64.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from kernels_cpu import ops
from kernels_cpu.attention import paged_attention, store_kv


class StoredAsIs:
    """K or V rows stored as computed (f16, f32)."""

    def encode_k(self, q: np.ndarray, k: np.ndarray, k_shift: np.ndarray | None) -> None:
        """Make q f32[T, H, hd] and k f32[T, H_kv, hd] ready to store k and attend (in place)."""

    def encode_v(self, v: np.ndarray) -> None:
        """Make v f32[T, H_kv, hd_v] ready to store (in place)."""

    def decode_v(self, out: np.ndarray) -> None:
        """Undo encode_v on the attention output out f32[T, H, hd_v] (in place)."""


class Quantized(StoredAsIs):
    """Rows quantized to 8-bit blocks (q8_0): K shifted and rotated, V rotated (module docstring)."""

    def encode_k(self, q, k, k_shift):
        if k_shift is not None:
            k -= k_shift
        n = hadamard_size(k.shape[2])
        if n:
            ops.rotate_chunks(q, n)
            ops.rotate_chunks(k, n)

    def encode_v(self, v):
        if v.shape[2] % 64 == 0:
            ops.rotate_chunks(v, 64)

    def decode_v(self, out):
        if out.shape[2] % 64 == 0:
            ops.rotate_chunks(out, 64)


CODECS = {"f16": StoredAsIs(), "f32": StoredAsIs(), "q8_0": Quantized()}   # by KV type


@lru_cache(maxsize=None)
def hadamard_size(head_dim: int) -> int:
    """The Hadamard order llama.cpp rotates Q and K by for a quantized K cache: the largest power
    of two from 64 up that divides head_dim, 0 when 64 does not (llama_kv_cache::build_input_k_rot)."""
    if head_dim % 64:
        return 0
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def store_and_attend(cache, il: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_ids: np.ndarray,
                     positions: np.ndarray, window: int, scale: np.float32, out: np.ndarray | None,
                     k_shift: np.ndarray | None = None, batch_invariant: bool = False,
                     softcap: float = 0.0) -> np.ndarray | None:
    """Write a batch's K/V of layer ``il`` into ``cache`` in its types, then attend.

    Args:
        cache: a KV cache (edge.kv.cache.PagedKVCache, edge.kv.contiguous.KVCache): pools
            k[il], v[il], layer_tables(il), type_k, type_v.
        q, k, v: f32[T, n_head, hd], f32[T, n_head_kv, hd], f32[T, n_head_kv, hd_v], C-contiguous;
            changed in place (they are the caller's scratch).
        seq_ids, positions: int32[T]: row t is position positions[t] of sequence seq_ids[t].
        window: sliding window in tokens (0: full attention). scale: float32 softmax scale.
        out: f32[T, n_head, hd_v] for the attention output, or None to store the K/V only.
        k_shift: f32[n_head_kv, hd], the static part of the layer's K bias, or None.
        batch_invariant: each row computed as a batch of one (kernels_cpu.attention).
        softcap: soft-capping of the scores before the softmax (0: none; Gemma 2).
    Returns out, or None when out is None.
    """
    kc, vc = CODECS[cache.type_k], CODECS[cache.type_v]
    kc.encode_k(q, k, k_shift)
    vc.encode_v(v)
    T = q.shape[0]
    k_pool, v_pool, tables = cache.k[il], cache.v[il], cache.layer_tables(il)
    store_kv(k.reshape(T, -1), k_pool, tables, seq_ids, positions)
    store_kv(v.reshape(T, -1), v_pool, tables, seq_ids, positions)
    if out is None:
        return None
    paged_attention(q, k_pool, v_pool, tables, seq_ids, positions, window, scale, out, batch_invariant, softcap)
    vc.decode_v(out)
    return out
