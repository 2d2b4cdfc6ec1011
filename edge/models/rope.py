"""Rotary position embeddings: the variants the architectures use, and the part of a K bias
RoPE leaves in place.

A :class:`Rope` is one ggml_rope_ext without YaRN: the first n_rot dimensions of every head
turn by angle position * freq_scale * base^(-2i/n_rot) / freq_factors[i] for pair i, the pairs
being (2i, 2i+1) (llama's NORM mode) or (i, i + n_rot/2) (GPT-NeoX, Qwen2, Gemma). Linear
scaling is freq_scale = 1 / rope.scaling.factor; llama 3's ``rope_freqs`` tensor gives the
freq_factors; ``attn_factor`` (rope.scaling.attn_factor) multiplies cos and sin. Phi-3's
LongRoPE (:class:`LongRope`) is two such variants, short and long factors, of which the
context size picks one. A model's layers share their Rope objects, so a forward pass computes
the cos/sin tables of each once (edge.models.layers.Batch).
"""
from __future__ import annotations

import numpy as np

from edge.models.hparams import ModelArgs
from kernels_cpu import ops


class Rope:
    """One RoPE variant (module docstring).

    Args:
        n_rot: dimensions rotated (even, at most head_dim).
        base: frequency base (rope.freq_base).
        scale: frequency scale (1 / linear scaling factor).
        neox: GPT-NeoX pairing (i, i + n_rot/2); else (2i, 2i+1).
        freq_factors: float32[n_rot/2] dividing each pair's angle, or None.
        attn_factor: multiplies cos and sin (ggml_rope_ext's attn_factor, the mscale of
            ggml's rope_yarn without YaRN's extrapolation); 1.0 leaves them as they are.
    """

    __slots__ = ("n_rot", "base", "scale", "neox", "freq_factors", "attn_factor")

    def __init__(self, n_rot: int, base: float, scale: float = 1.0, neox: bool = False,
                 freq_factors: np.ndarray | None = None, attn_factor: float = 1.0):
        self.n_rot, self.base, self.scale, self.neox, self.freq_factors = n_rot, base, scale, neox, freq_factors
        self.attn_factor = attn_factor

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) float32[T, n_rot/2] for positions int[T] (ops.rope_cos_sin; times
        attn_factor in float32, as ggml's cosf(theta) * mscale)."""
        cos, sin = ops.rope_cos_sin(positions, self.n_rot, self.base, self.scale, self.freq_factors)
        if self.attn_factor != 1.0:
            cos *= np.float32(self.attn_factor)
            sin *= np.float32(self.attn_factor)
        return cos, sin

    def __call__(self, x: np.ndarray, batch) -> None:
        """Rotate x f32[T, H, head_dim] in place at the positions of ``batch``
        (edge.models.layers.Batch, which holds the tables)."""
        cos, sin = batch.rope_tables(self)
        ops.rope(x, cos, sin, self.neox)


class LongRope:
    """Phi-3's LongRoPE: the Rope with the short factors (``rope_factors_short``) or the one with
    the long factors (``rope_factors_long``), picked per forward pass by the cache's context
    size, as llama.cpp's llama_model::get_rope_factors: long when n_ctx_seq (the cache's
    per-sequence n_ctx rounded up to a multiple of 256, as llama.cpp pads n_ctx) exceeds
    ``n_ctx_orig`` (rope.scaling.original_context_length)."""

    __slots__ = ("short", "long", "n_ctx_orig")

    PAD = 256   # llama.cpp: cparams.n_ctx_seq = GGML_PAD(n_ctx / n_seq, 256)

    def __init__(self, short: Rope, long: Rope, n_ctx_orig: int):
        self.short, self.long, self.n_ctx_orig = short, long, n_ctx_orig

    def pick(self, n_ctx: int) -> Rope:
        """The Rope for a cache of n_ctx positions per sequence."""
        return self.long if -(-n_ctx // self.PAD) * self.PAD > self.n_ctx_orig else self.short

    def __call__(self, x: np.ndarray, batch) -> None:
        """Rope.__call__ with the factors batch.cache.n_ctx picks."""
        self.pick(batch.cache.n_ctx)(x, batch)


def static_k_bias(a: ModelArgs, k_bias: np.ndarray, is_swa: bool = False,
                  rope_freqs: np.ndarray | None = None) -> np.ndarray:
    """The part of a K bias that RoPE leaves (nearly) in place: f32[n_head_kv, head_dim].

    k_bias is f32[n_head_kv * head_dim]. Entry d keeps the bias where dimension d is not
    rotated (d >= n_rot) or belongs to a RoPE pair whose angle stays within 1 radian over the
    training context (theta_i * n_ctx_train <= 1), and is 0 elsewhere.

    Why: a quantized K cache may store K minus this vector (edge.kv.codec). Every key of a head
    loses the same vector c, so each score q.k drops by the same q.c and softmax is unchanged
    (exact up to rounding). It matters for Qwen2.5, whose K biases put constants of 50 to 210
    on the slowest RoPE pairs of a few layers while the rest of K varies by a few units: a q8_0
    block's scale follows the constant and the varying part loses most of its bits.
    """
    hd, half = a.head_dim, a.n_rot // 2
    base = a.rope_freq_base_swa if is_swa else a.rope_freq_base
    scale = a.rope_freq_scale_swa if is_swa else a.rope_freq_scale
    theta = scale * np.float64(base) ** (-2.0 * np.arange(half) / a.n_rot)   # rad per position
    if rope_freqs is not None and not is_swa:
        theta = theta / np.asarray(rope_freqs, np.float64)
    pair_static = theta * a.n_ctx_train <= 1.0                                 # [n_rot/2]
    static = np.ones(hd, bool)
    if a.rope_neox:                       # pairs (i, i + n_rot/2)
        static[:half] = pair_static
        static[half:a.n_rot] = pair_static
    else:                                 # pairs (2i, 2i + 1)
        static[0:a.n_rot:2] = pair_static
        static[1:a.n_rot:2] = pair_static
    c = np.asarray(k_bias, np.float32).reshape(a.n_head_kv, hd).copy()
    c[:, ~static] = 0
    return c


class NoRope:
    """The identity in a Rope's place: layers that apply no rotary embedding (smollm3's every
    4th layer, llama.cpp's use_rope = false)."""

    __slots__ = ()

    def __call__(self, x: np.ndarray, batch) -> None:
        """Leave x f32[T, H, head_dim] as it is."""
