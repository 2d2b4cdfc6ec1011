"""The small layers an architecture's block is written with (edge.models.llama, qwen2, gemma3).

A block's forward pass is a few lines of these, in the order of llama.cpp's llm_build_* graph:
:func:`rms_norm`, :func:`project_qkv` and :func:`heads`, a :class:`~edge.models.rope.Rope`,
:meth:`Block.attend` (K/V into the cache, attention, attn_output: the KV cache's types decide
how K/V are stored, edge.kv.codec), :func:`ffn_swiglu` / :func:`ffn_geglu`, and :meth:`Batch.keep`
for the last layer's output rows. Every function writes into the forward pass's reusable
buffers (:class:`Scratch`), so a decode step allocates no activations; each reproduces the
ggml operators of llama.cpp's CPU backend bit for bit (kernels_cpu).
"""
from __future__ import annotations

import math

import numpy as np

from edge.kv.codec import store_and_attend
from edge.models.hparams import ModelArgs
from edge.models.weights import Tensor, Weight, optional, tensor
from kernels_cpu import ops
from kernels_cpu.matmul import MatmulWorkspace, quantize_activations


# The tensors of the shared layers, for an architecture's LAYER_TENSORS (edge.models.weights):
# those project_qkv and Block.attend read (with the pre-attention norm) ...
ATTENTION_TENSORS = [
    tensor("attn_norm.weight", "n_embd"),
    tensor("attn_q.weight", "n_embd", "n_head * head_dim"),
    tensor("attn_k.weight", "n_embd", "n_head_kv * head_dim"),
    tensor("attn_v.weight", "n_embd", "n_head_kv * head_dim_v"),
    tensor("attn_output.weight", "n_head * head_dim_v", "n_embd"),
]
# ... the biases of q, k and v ...
QKV_BIAS_TENSORS = [
    tensor("attn_q.bias", "n_head * head_dim"),
    tensor("attn_k.bias", "n_head_kv * head_dim"),
    tensor("attn_v.bias", "n_head_kv * head_dim_v"),
]
# ... and those of ffn_swiglu / ffn_geglu (with the pre-FFN norm)
GATED_FFN_TENSORS = [
    tensor("ffn_norm.weight", "n_embd"),
    tensor("ffn_gate.weight", "n_embd", "n_ff"),
    tensor("ffn_up.weight", "n_embd", "n_ff"),
    tensor("ffn_down.weight", "n_ff", "n_embd"),
]


def optional_all(tensors: list[Tensor]) -> list[Tensor]:
    """The same tensors, each one a file may lack."""
    return [optional(t.name, *t.shape) for t in tensors]


class Scratch:
    """Buffers a forward pass reuses from call to call, so that a decode step allocates no
    activations: named float32 arrays and a matmul workspace, grown when a batch needs more.
    A model's forward is not reentrant (one caller at a time)."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self._bufs: dict[str, np.ndarray] = {}
        self._views: dict[tuple, np.ndarray] = {}     # (name, shape) -> view of _bufs[name]
        self._ws: MatmulWorkspace | None = None

    def get(self, name: str, shape: tuple) -> np.ndarray:
        """A C-contiguous float32 array of ``shape`` (contents undefined), valid until the next
        get() of the same name."""
        view = self._views.get((name, shape))
        if view is not None:
            return view
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.size < n:
            buf = self._bufs[name] = np.empty(max(n, 1), np.float32)
            self._views = {key: v for key, v in self._views.items() if key[0] != name}
        if len(self._views) >= 4096:                  # many batch shapes seen: start afresh
            self._views.clear()
        view = self._views[(name, shape)] = buf[:n].reshape(shape)
        return view

    def workspace(self, n_tokens: int) -> MatmulWorkspace:
        """A matmul workspace for up to n_tokens rows of up to max_k values."""
        if self._ws is None or self._ws.max_tokens < n_tokens:
            self._ws = MatmulWorkspace(n_tokens, self.max_k)
        return self._ws


class Batch:
    """One forward pass's rows and what its layers share.

    Attributes: cache (the KV cache), seq_ids and positions int32[T] (row t continues sequence
    seq_ids[t] at positions[t]), ws (the matmul workspace for T rows), batch_invariant
    (Transformer.set_batch_invariant), out_rows (None, or in the last layer the rows the rest
    of the block keeps after attention: an index array or a slice, as llama.cpp's inp_out_ids).
    """

    __slots__ = ("cache", "seq_ids", "positions", "scratch", "ws", "batch_invariant", "out_rows", "_tables")

    def __init__(self, cache, seq_ids: np.ndarray, positions: np.ndarray, scratch: Scratch, batch_invariant: bool):
        self.cache, self.seq_ids, self.positions, self.scratch = cache, seq_ids, positions, scratch
        self.ws = scratch.workspace(len(positions))
        self.batch_invariant = batch_invariant
        self.out_rows = None
        self._tables: dict = {}

    def buf(self, name: str, shape: tuple) -> np.ndarray:
        """Scratch.get: a reusable float32 buffer (contents undefined)."""
        return self.scratch.get(name, shape)

    def rope_tables(self, rope) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) of ``rope`` (edge.models.rope.Rope) at these positions, computed once."""
        t = self._tables.get(rope)
        if t is None:
            t = self._tables[rope] = rope.tables(self.positions)
        return t

    @property
    def kv_only(self) -> bool:
        """No row of this layer is wanted past attention: only its K/V are stored."""
        return isinstance(self.out_rows, np.ndarray) and self.out_rows.size == 0

    def keep(self, x: np.ndarray) -> np.ndarray:
        """The rows of x f32[T, n] the rest of the layer computes: all but in the last layer."""
        return x if self.out_rows is None else np.ascontiguousarray(x[self.out_rows])


class Block:
    """One layer of an architecture (subclassed per architecture, which writes __call__).

    Its tensors are attributes named as in the GGUF file (edge.models.weights.Tensor.attr:
    ``blk.N.attn_q.weight`` is attn_q, ``blk.N.attn_q.bias`` attn_q_bias). The facts its
    attention hands the KV cache are attributes too: ``window`` (sliding window in tokens, 0:
    full attention), ``kq_scale`` (float32 softmax scale of the scores, default
    1/sqrt(head_dim)), ``softcap`` (soft-capping of the scores before the softmax, 0: none)
    and ``k_shift`` (None, or the static part of the K bias, f32[n_head_kv, head_dim], that a
    quantized K cache may store K without: edge.kv.codec).
    """

    def __init__(self, w: dict, a: ModelArgs, il: int):
        vars(self).update(w)
        self.args, self.il = a, il
        self.window = a.sliding_window if a.swa_layers[il] else 0
        self.kq_scale = np.float32(1) / np.sqrt(np.float32(a.head_dim))
        self.softcap = 0.0
        self.k_shift: np.ndarray | None = None

    def __call__(self, x: np.ndarray, b: Batch) -> np.ndarray | None:
        """The layer on x f32[T, n_embd] (updated in place): f32[rows, n_embd] for the rows
        b.keep keeps, or None when none is wanted (b.kv_only: the K/V are stored)."""
        raise NotImplementedError

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, b: Batch) -> np.ndarray | None:
        """Store the rows' K/V in the cache, attend, and project by attn_output (llama.cpp's
        build_attn): q f32[T, n_head, hd], k f32[T, n_head_kv, hd], v f32[T, n_head_kv, hd_v]
        (scratch: the KV side may change them). Returns f32[rows, n_embd] for the rows b.keep
        keeps, or None when b.kv_only."""
        T, H = q.shape[:2]
        out = None if b.kv_only else b.buf("attn", (T, H, v.shape[2]))
        if store_and_attend(b.cache, self.il, q, k, v, b.seq_ids, b.positions, self.window, self.kq_scale,
                            out, self.k_shift, b.batch_invariant, self.softcap) is None:
            return None
        wo = self.attn_output
        return b.keep(wo(out.reshape(T, -1), b.buf("o", (T, wo.n_out)), workspace=b.ws))


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
    """RMSNorm times weight (ggml_rms_norm, ggml_mul): x, out f32[T, n] (out may be x),
    weight f32[n]. Returns out."""
    ops.rms_norm(x, weight, eps, out)
    return out


def rms_norm_heads(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of every head vector in place (per-head q/k norms): x f32[T, H, hd], weight
    f32[hd]. Returns x."""
    ops.rms_norm_heads(x, weight, eps)
    return x


def project_qkv(h: np.ndarray, wq: Weight, wk: Weight, wv: Weight, b: Batch):
    """(h @ wq.T, h @ wk.T, h @ wv.T), f32[T, n_out] each, h quantized once for the three
    (as ggml converts src1 once for weights of one activation format)."""
    T = h.shape[0]
    hq = quantize_activations(wq.ggml_type, h, b.ws)
    return (wq(h, b.buf("q", (T, wq.n_out)), hq, b.ws), wk(h, b.buf("k", (T, wk.n_out)), hq, b.ws),
            wv(h, b.buf("v", (T, wv.n_out)), hq, b.ws))


def heads(x: np.ndarray, n_head: int) -> np.ndarray:
    """f32[T, n_head * d] viewed as f32[T, n_head, d]."""
    return x.reshape(x.shape[0], n_head, -1)


def _gated_ffn(h: np.ndarray, gate: Weight, up: Weight, down: Weight, b: Batch, act) -> np.ndarray:
    R = h.shape[0]
    hq = quantize_activations(gate.ggml_type, h, b.ws)                 # shared by gate, up
    g = gate(h, b.buf("g", (R, gate.n_out)), hq, b.ws)                  # [R, n_ff]
    u = up(h, b.buf("u", (R, up.n_out)), hq, b.ws)                      # [R, n_ff]
    act(g, u, g)
    return down(g, b.buf("d", (R, down.n_out)), workspace=b.ws)         # [R, n_embd]


def ffn_swiglu(h: np.ndarray, gate: Weight, up: Weight, down: Weight, b: Batch) -> np.ndarray:
    """down(silu(gate(h)) * up(h)) (build_ffn with LLM_FFN_SILU, LLM_FFN_PAR): h f32[R, n_embd]
    -> f32[R, n_embd] (a scratch buffer)."""
    return _gated_ffn(h, gate, up, down, b, ops.silu_mul)


def ffn_geglu(h: np.ndarray, gate: Weight, up: Weight, down: Weight, b: Batch) -> np.ndarray:
    """down(gelu(gate(h)) * up(h)) (build_ffn with LLM_FFN_GELU, LLM_FFN_PAR; GELU's tanh
    approximation): h f32[R, n_embd] -> f32[R, n_embd] (a scratch buffer)."""
    return _gated_ffn(h, gate, up, down, b, ops.gelu_mul)
