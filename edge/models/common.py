"""The decoder-only transformer shared by the architectures, and its weights.

An architecture module (``llama.py``, ``qwen2.py``, ``gemma3.py``) reads its ModelArgs from GGUF
metadata (edge.models.hparams, which checks every value against the tensors before anything is
sized by it) and says which optional parts its blocks have (QKV bias, q/k norms, post-norms,
activation, sliding-window layers); the forward pass here runs them. Attribute
names equal GGUF tensor names (``attn_q``, ``ffn_down``, ``output_norm``). Weights stay in
their GGML block formats inside the memory-mapped file; only 1-D tensors (norms, biases) are
read as float32.
"""
from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType

from edge.gguf_file import GGUFError, GGUFFile
from edge.models.hparams import ModelArgs
from kernels_cpu import ops
from kernels_cpu.attention import attention_f16, store_kv
from kernels_cpu.dequant import dequantize, dequantize_rows
from kernels_cpu.matmul import MatmulWorkspace, matmul, quantize_activations


class Weight:
    """A 2-D weight matrix kept in its GGML block format (zero-copy view of the file).

    ``rows`` is uint8[n_out, row_bytes]; calling it computes ``x @ W.T``: x f32[T, n_in]
    -> f32[T, n_out], through kernels_cpu.matmul (activations quantized as llama.cpp does).
    ``observer`` (default None) is called as observer(name, x) before each product: the
    activations an importance matrix is made of (edge.imatrix; ggml's eval callback).
    """

    __slots__ = ("name", "ggml_type", "rows", "n_in", "n_out", "batch_invariant", "observer")

    def __init__(self, gf: GGUFFile, name: str, n_in: int, n_out: int | None = None):
        t = gf.tensors[name]
        if len(t.shape) != 2 or t.shape[0] != n_in or (n_out is not None and t.shape[1] != n_out):
            want = (n_in, "n") if n_out is None else (n_in, n_out)
            raise GGUFError(f"{gf.path}: tensor {name!r} has shape {t.shape}, expected {want}")
        self.name = name
        self.ggml_type = t.ggml_type
        self.rows = gf.tensor_rows(name)
        self.n_in, self.n_out = t.shape
        self.batch_invariant = False   # see Transformer.set_batch_invariant
        self.observer = None           # see Transformer.set_observer

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None, xq=None, workspace=None) -> np.ndarray:
        """x f32[T, n_in] -> out f32[T, n_out] (kernels_cpu.matmul.matmul: ``xq`` x already
        quantized for a weight of the same activation format, ``workspace`` its buffers)."""
        if self.observer is not None:
            self.observer(self.name, x)
        return matmul(self.rows, self.ggml_type, x, out, workspace, xq, self.batch_invariant)

    def get_rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows ``ids`` (embedding lookup, ggml_get_rows): f32[len(ids), n_in]."""
        out = np.empty((len(ids), self.n_in), dtype=np.float32)
        return dequantize_rows(self.rows, self.ggml_type, np.asarray(ids, dtype=np.int64), out)


class Scratch:
    """Buffers a forward pass reuses from call to call, so that a decode step allocates no
    activations: named float32 arrays and a matmul workspace, grown when a batch needs more.
    A model's forward is not reentrant (one caller at a time)."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self._bufs: dict[str, np.ndarray] = {}
        self._ws: MatmulWorkspace | None = None

    def get(self, name: str, shape: tuple) -> np.ndarray:
        """A C-contiguous float32 array of ``shape`` (contents undefined), valid until the next
        get() of the same name."""
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.size < n:
            buf = self._bufs[name] = np.empty(max(n, 1), np.float32)
        return buf[:n].reshape(shape)

    def workspace(self, n_tokens: int) -> MatmulWorkspace:
        """A matmul workspace for up to n_tokens rows of up to max_k values."""
        if self._ws is None or self._ws.max_tokens < n_tokens:
            self._ws = MatmulWorkspace(n_tokens, self.max_k)
        return self._ws


class TensorLoader:
    """Hands out a GGUF file's tensors by name and remembers which were taken.

    A missing required tensor, a wrong shape, or (at :meth:`check_all_used`) a tensor no part
    of the architecture took is a GGUFError naming the tensor, as llama.cpp refuses files with
    missing or unused tensors.
    """

    def __init__(self, gf: GGUFFile):
        self.gf = gf
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def _take(self, name: str) -> None:
        if name not in self.gf.tensors:
            raise GGUFError(f"{self.gf.path}: required tensor {name!r} is missing")
        self.used.add(name)

    def weight(self, name: str, n_in: int, n_out: int | None = None) -> Weight:
        """A 2-D weight of shape (ggml order) [n_in, n_out]."""
        self._take(name)
        return Weight(self.gf, name, n_in, n_out)

    def vector(self, name: str, n: int, required: bool = True) -> np.ndarray | None:
        """A 1-D tensor (norm weight or bias) as float32[n]; F32 tensors are zero-copy views."""
        if not required and name not in self.gf.tensors:
            return None
        self._take(name)
        t = self.gf.tensors[name]
        if t.n_elements != n:
            raise GGUFError(f"{self.gf.path}: tensor {name!r} has {t.n_elements} elements, expected {n}")
        if t.ggml_type == GGMLQuantizationType.F32:
            return self.gf.tensor_f32(name).reshape(n)
        return dequantize(self.gf.tensor_bytes(name), t.ggml_type).reshape(n)

    def check_all_used(self, arch: str) -> None:
        extra = [n for n in self.gf.tensors if n not in self.used]
        if extra:
            shown = ", ".join(extra[:8]) + (" ..." if len(extra) > 8 else "")
            raise GGUFError(f"{self.gf.path}: {len(extra)} tensors are not used by the "
                            f"{arch} architecture: {shown}")


class KVCache:
    """A contiguous KV cache with ``n_seq`` sequence slots (the reference for edge.kv's paged
    cache, and the cache of perplexity runs).

    k[l], v[l]: uint16[n_seq, n_ctx, n_head_kv, head_dim] (f16 bits; float32 for kv_type
    "f32"); cell j of slot s holds
    position j of sequence s. ``pos`` int64[n_seq] counts the positions each slot has filled.
    Memory comes from np.zeros, so pages that are never written cost no RAM.
    """

    def __init__(self, args: ModelArgs, n_ctx: int, n_seq: int = 1, kv_type: str = "f16"):
        if n_ctx < 1 or n_seq < 1:
            raise ValueError(f"a KV cache needs n_ctx >= 1 and n_seq >= 1, got {n_ctx}, {n_seq}")
        if kv_type not in ("f16", "f32"):
            raise ValueError(f"the contiguous KV cache holds f16 or f32, not {kv_type!r}")
        self.n_ctx, self.n_seq = n_ctx, n_seq
        dt = np.uint16 if kv_type == "f16" else np.float32
        self.k = [np.zeros((n_seq, n_ctx, args.n_head_kv, args.head_dim), dt) for _ in range(args.n_layer)]
        self.v = [np.zeros((n_seq, n_ctx, args.n_head_kv, args.head_dim_v), dt) for _ in range(args.n_layer)]
        self.pos = np.zeros(n_seq, np.int64)
        self.tables = np.arange(n_seq, dtype=np.int32).reshape(n_seq, 1)  # slot s = block s of n_ctx cells

    def layer_tables(self, il: int) -> np.ndarray:
        """Block tables int32[n_seq, max_blocks] of layer il's K/V pools (attention_f16)."""
        return self.tables

    def prepare(self, runs: np.ndarray, lengths: np.ndarray) -> None:
        """Before a forward writing lengths[i] positions of sequence runs[i] (nothing to do)."""

    def commit(self, runs: np.ndarray, lengths: np.ndarray) -> None:
        """After that forward: the positions are filled."""
        self.pos[runs] += lengths

    @property
    def n_past(self) -> int:
        """Positions filled in slot 0 (the only slot of a single-sequence cache)."""
        return int(self.pos[0])

    @n_past.setter
    def n_past(self, n: int) -> None:
        self.pos[0] = n

    @property
    def nbytes(self) -> int:
        """Bytes reserved for K and V (all layers and slots)."""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


class Block:
    """One transformer block: attention then gated FFN, each pre-normed, residual added.

    Tensors (GGUF names): attn_norm, attn_q/k/v (+ .bias with qkv_bias), attn_q_norm and
    attn_k_norm (qk_norm), attn_output, post_attention_norm (post_norms), ffn_norm, ffn_gate,
    ffn_up, ffn_down, post_ffw_norm (post_norms).
    """

    def __init__(self, ld: TensorLoader, a: ModelArgs, il: int):
        p = f"blk.{il}."
        d, hd, hd_v = a.n_embd, a.head_dim, a.head_dim_v
        self.attn_norm = ld.vector(p + "attn_norm.weight", d)                        # [n_embd]
        self.attn_q = ld.weight(p + "attn_q.weight", d, a.n_head * hd)               # [n_embd, n_head*hd]
        self.attn_k = ld.weight(p + "attn_k.weight", d, a.n_head_kv * hd)            # [n_embd, n_head_kv*hd]
        self.attn_v = ld.weight(p + "attn_v.weight", d, a.n_head_kv * hd_v)          # [n_embd, n_head_kv*hd_v]
        self.attn_output = ld.weight(p + "attn_output.weight", a.n_head * hd_v, d)   # [n_head*hd_v, n_embd]
        self.ffn_norm = ld.vector(p + "ffn_norm.weight", d)                          # [n_embd]
        self.ffn_gate = ld.weight(p + "ffn_gate.weight", d, a.n_ff)                  # [n_embd, n_ff]
        self.ffn_up = ld.weight(p + "ffn_up.weight", d, a.n_ff)                      # [n_embd, n_ff]
        self.ffn_down = ld.weight(p + "ffn_down.weight", a.n_ff, d)                  # [n_ff, n_embd]
        bias = a.qkv_bias  # True: required, None: optional (llama), False: absent
        self.attn_q_bias = self.attn_k_bias = self.attn_v_bias = None
        if bias is not False:
            req = bool(bias)
            self.attn_q_bias = ld.vector(p + "attn_q.bias", a.n_head * hd, req)       # [n_head*hd]
            self.attn_k_bias = ld.vector(p + "attn_k.bias", a.n_head_kv * hd, req)    # [n_head_kv*hd]
            self.attn_v_bias = ld.vector(p + "attn_v.bias", a.n_head_kv * hd_v, req)  # [n_head_kv*hd_v]
            if (self.attn_q_bias is None) != (self.attn_k_bias is None) or \
                    (self.attn_q_bias is None) != (self.attn_v_bias is None):
                raise GGUFError(f"{ld.gf.path}: {p}attn_q/k/v.bias must be all present or all absent")
        self.attn_q_norm = self.attn_k_norm = None
        if a.qk_norm:
            self.attn_q_norm = ld.vector(p + "attn_q_norm.weight", hd)                # [hd]
            self.attn_k_norm = ld.vector(p + "attn_k_norm.weight", hd)                # [hd]
        self.post_attention_norm = self.post_ffw_norm = None
        if a.post_norms:
            self.post_attention_norm = ld.vector(p + "post_attention_norm.weight", d)  # [n_embd]
            self.post_ffw_norm = ld.vector(p + "post_ffw_norm.weight", d)              # [n_embd]
        self.is_swa = a.swa_layers[il]
        self.window = a.sliding_window if self.is_swa else 0
        self.k_rotation = _k_rotation(hd) if hd % 64 == 0 else 0
        self.k_shift: np.ndarray | None = None   # f32[n_head_kv, hd], set by Transformer (static_k_bias)
        self.batch_invariant = False             # see Transformer.set_batch_invariant
        self.args = a

    def __call__(self, x: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray, rope_cs, k_pool, v_pool,
                 tables, scratch: Scratch, out_rows=None) -> np.ndarray:
        """Run the block on x f32[T, n_embd]; write row t's K/V at position positions[t] of
        sequence seq_ids[t] (int32[T] each) into the pools k_pool/v_pool through the block
        tables (kernels_cpu.attention.attention_f16 gives the layouts).

        Returns the block output f32[T, n_embd] (x, updated in place), or only the rows
        ``out_rows`` when given: as llama.cpp's last layer (inp_out_ids), attention runs on
        every row and the rest of the block on the output rows alone (none: K/V stored, no
        attention, an empty result).
        """
        a = self.args
        T = x.shape[0]
        sc = scratch
        ws = sc.workspace(T)
        h = sc.get("h", x.shape)
        ops.rms_norm(x, self.attn_norm, a.rms_eps, h)
        hq = quantize_activations(self.attn_q.ggml_type, h, ws)            # shared by Q, K, V
        q = self.attn_q(h, sc.get("q", (T, self.attn_q.n_out)), hq, ws)  # [T, n_head*hd]
        k = self.attn_k(h, sc.get("k", (T, self.attn_k.n_out)), hq, ws)  # [T, n_head_kv*hd]
        v = self.attn_v(h, sc.get("v", (T, self.attn_v.n_out)), hq, ws)  # [T, n_head_kv*hd_v]
        if self.attn_q_bias is not None:
            q += self.attn_q_bias
            k += self.attn_k_bias
            v += self.attn_v_bias
        q = q.reshape(T, a.n_head, a.head_dim)
        k = k.reshape(T, a.n_head_kv, a.head_dim)
        if self.attn_q_norm is not None:
            ops.rms_norm_heads(q, self.attn_q_norm, a.rms_eps)
            ops.rms_norm_heads(k, self.attn_k_norm, a.rms_eps)
        cos, sin = rope_cs
        ops.rope(q, cos, sin, a.rope_neox)
        ops.rope(k, cos, sin, a.rope_neox)
        if a.query_scale:
            q *= np.float32(a.query_scale)
        quant_k = k_pool.dtype == np.uint8
        rot_k = quant_k and self.k_rotation > 0                        # llama.cpp's attn_rot_k
        rot_v = v_pool.dtype == np.uint8 and a.head_dim_v % 64 == 0   # and attn_rot_v
        if quant_k and self.k_shift is not None:   # exact: softmax(q.k - q.c) = softmax(q.k)
            k -= self.k_shift
        if rot_k:                              # quantized K: Q and K rotated alike (Q.K unchanged)
            ops.rotate_chunks(q, self.k_rotation)
            ops.rotate_chunks(k, self.k_rotation)
        if rot_v:                              # quantized V: rotated in blocks of 64, undone below
            ops.rotate_chunks(v, 64)
        store_kv(k.reshape(T, -1), k_pool, tables, seq_ids, positions)
        store_kv(v.reshape(T, -1), v_pool, tables, seq_ids, positions)
        if isinstance(out_rows, np.ndarray) and out_rows.size == 0:   # only this layer's K/V was wanted
            return x[:0]
        attn = sc.get("attn", (T, a.n_head, a.head_dim_v))
        scale = np.float32(a.attention_scale) if a.attention_scale else np.float32(1) / np.sqrt(np.float32(a.head_dim))
        attention_f16(q, k_pool, v_pool, tables, seq_ids, positions, self.window, scale, attn, self.batch_invariant)
        if rot_v:
            ops.rotate_chunks(attn, 64)
        o = self.attn_output(attn.reshape(T, -1), sc.get("o", x.shape), workspace=ws)  # [T, n_embd]
        if out_rows is not None:
            o = np.ascontiguousarray(o[out_rows])                          # [rows, n_embd]
            x = np.ascontiguousarray(x[out_rows])                          # [rows, n_embd]
            h = sc.get("h", x.shape)
        if self.post_attention_norm is not None:
            ops.rms_norm(o, self.post_attention_norm, a.rms_eps, o)
        x += o
        ops.rms_norm(x, self.ffn_norm, a.rms_eps, h)
        R = x.shape[0]
        hq = quantize_activations(self.ffn_gate.ggml_type, h, ws)          # shared by gate, up
        g = self.ffn_gate(h, sc.get("g", (R, a.n_ff)), hq, ws)             # [R, n_ff]
        u = self.ffn_up(h, sc.get("u", (R, a.n_ff)), hq, ws)               # [R, n_ff]
        if a.activation == "gelu":
            ops.gelu_mul(g, u, g)
        else:
            ops.silu_mul(g, u, g)
        d = self.ffn_down(g, sc.get("d", x.shape), workspace=ws)           # [R, n_embd]
        if self.post_ffw_norm is not None:
            ops.rms_norm(d, self.post_ffw_norm, a.rms_eps, d)
        x += d
        return x


class Transformer:
    """A decoder-only transformer over GGUF weights.

    Tensors: token_embd [n_vocab, n_embd], blk.N.*, output_norm [n_embd], output
    [n_vocab, n_embd] (tied to token_embd when absent). The caller owns the thread count
    (edge.generate.forward: edge.threads.AdaptiveThreads, checked between layers through
    ``layer_callback``).
    """

    def __init__(self, gf: GGUFFile, args: ModelArgs):
        args.check(gf)   # every size and index below comes from args, now held to the tensors
        self.args = args
        self.gguf = gf
        ld = TensorLoader(gf)
        self.token_embd = ld.weight("token_embd.weight", args.n_embd, args.n_vocab)  # [n_embd, n_vocab]
        self.blocks = [Block(ld, args, il) for il in range(args.n_layer)]
        self.output_norm = ld.vector("output_norm.weight", args.n_embd)               # [n_embd]
        if ld.has("output.weight"):
            self.output = ld.weight("output.weight", args.n_embd, args.n_vocab)       # [n_embd, n_vocab]
        else:
            self.output = self.token_embd                                              # tied
        self.rope_freqs = ld.vector("rope_freqs.weight", args.n_rot // 2, required=False)  # [n_rot/2]
        for blk in self.blocks:
            if blk.attn_k_bias is not None and blk.attn_k_norm is None:
                blk.k_shift = static_k_bias(args, blk.attn_k_bias, blk.is_swa, self.rope_freqs)
        self.scratch = Scratch(max(args.n_embd, args.n_ff, args.n_head * args.head_dim_v))
        self.batch_invariant = False
        ld.check_all_used(args.arch)

    def set_batch_invariant(self, on: bool = True) -> None:
        """With ``on``, every row of a batch is computed with one arithmetic whatever the batch
        (kernels_cpu.matmul's batch_invariant kernels, attention in ggml_vec_dot_f16 order), so
        a token's logits depend only on its sequence, not on the batch or prefill chunking it
        was computed in. The server turns this on: a request's text must not depend on what
        else is being served. Attention and most K-quant matmuls keep llama.cpp's one-row
        arithmetic; Q5_0 / Q8_0 take the GEMV structure and Q6_K the tiled kernel's (faster in
        batches, last bits differ from llama.cpp's VEC_DOT). Default off: llama.cpp's choice
        of kernel per batch size."""
        for w in self.weights():
            w.batch_invariant = bool(on)
        for blk in self.blocks:
            blk.batch_invariant = bool(on)
        self.batch_invariant = bool(on)

    def weights(self) -> list[Weight]:
        """Every matrix the forward multiplies by (token_embd once, also when output is tied)."""
        found = {}
        for owner in [self, *self.blocks]:
            for value in vars(owner).values():
                if isinstance(value, Weight):
                    found[id(value)] = value
        return list(found.values())

    def set_observer(self, observer=None) -> None:
        """Call ``observer(weight_name, x f32[T, n_in])`` before every matrix product of the
        forward (None: off, the default; the check costs one attribute test per product)."""
        for w in self.weights():
            w.observer = observer

    def new_cache(self, n_ctx: int, n_seq: int = 1, kv_type: str = "f16") -> KVCache:
        """An empty contiguous KV cache of n_ctx positions for each of n_seq sequences."""
        return KVCache(self.args, n_ctx, n_seq, kv_type)

    def _rope_tables(self, positions: np.ndarray):
        a = self.args
        glob = ops.rope_cos_sin(positions, a.n_rot, a.rope_freq_base, a.rope_freq_scale, self.rope_freqs)
        local = glob
        if any(a.swa_layers):
            local = ops.rope_cos_sin(positions, a.n_rot, a.rope_freq_base_swa, a.rope_freq_scale_swa)
        return glob, local

    def forward(self, tokens, cache: KVCache, logits_rows=None, seq_ids=None,
                prune_last_layer: bool = True, layer_callback=None) -> np.ndarray:
        """Process ``tokens`` (int[T]) and append them to their sequences in ``cache``.

        ``seq_ids`` (int[T], default all 0) gives each row's sequence slot; the rows of one
        sequence must be consecutive and continue it at positions cache.pos[s], cache.pos[s]+1,
        ... So a prefill chunk is (tokens, cache) and one decode step of B sequences is
        (next_tokens[B], cache, seq_ids=[0..B-1]); both kinds of rows may share a batch.

        Returns logits f32[len(rows), n_vocab] for the batch rows ``logits_rows`` (default: the
        last row of each sequence in the batch, in order of appearance; ``slice(None)`` for
        all; no rows: only the K/V are computed, f32[0, n_vocab]). The last layer computes only
        those rows (as llama.cpp's inp_out_ids); ``prune_last_layer=False`` makes it compute
        every row (an importance matrix sees all of them) and still returns only those logits.
        ``layer_callback(il)``, when given, is called before each layer il (the caller's thread
        policy). Raises ValueError for an empty batch, a token id outside the vocabulary, a bad or
        interleaved sequence id, or rows that do not fit in n_ctx.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        if T == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.args.n_vocab:
            raise ValueError(f"token id out of range [0, {self.args.n_vocab})")
        seq_ids, positions, runs, lengths = _batch_positions(cache, T, seq_ids)
        last_rows = np.cumsum(lengths) - 1
        x = self.token_embd.get_rows(tokens)                               # [T, n_embd]
        if self.args.embed_scale != 1.0:
            x *= np.float32(self.args.embed_scale)
        if logits_rows is None:
            logits_rows = last_rows
        elif not isinstance(logits_rows, slice):
            logits_rows = np.asarray(logits_rows, np.int64)
        glob, local = self._rope_tables(positions)
        cache.prepare(runs, lengths)
        last = len(self.blocks) - 1
        for il, blk in enumerate(self.blocks):
            if layer_callback is not None:
                layer_callback(il)
            x = blk(x, seq_ids, positions, local if blk.is_swa else glob, cache.k[il], cache.v[il],
                    cache.layer_tables(il), self.scratch,
                    logits_rows if il == last and prune_last_layer else None)
        cache.commit(runs, lengths)
        if not prune_last_layer:
            x = x[logits_rows]
        if x.shape[0] == 0:                                                # no logits asked for
            return np.empty((0, self.args.n_vocab), np.float32)
        h = x                                                              # [rows, n_embd]
        ops.rms_norm(h, self.output_norm, self.args.rms_eps, h)
        logits = self.output(h)                                            # [rows, n_vocab]
        cap = self.args.final_logit_softcap
        if cap:
            ops.softcap(logits, cap)
        return logits


def static_k_bias(a: ModelArgs, k_bias: np.ndarray, is_swa: bool = False,
                  rope_freqs: np.ndarray | None = None) -> np.ndarray:
    """The part of a K bias that RoPE leaves (nearly) in place: f32[n_head_kv, head_dim].

    k_bias is f32[n_head_kv * head_dim]. Entry d keeps the bias where dimension d is not
    rotated (d >= n_rot) or belongs to a RoPE pair whose angle stays within 1 radian over the
    training context (theta_i * n_ctx_train <= 1), and is 0 elsewhere.

    Why: a quantized K cache stores K minus this vector. Every key of a head loses the same
    vector c, so each score q.k drops by the same q.c and softmax is unchanged (exact up to
    rounding). It matters for Qwen2.5, whose K biases put constants of 50 to 210 on the slowest
    RoPE pairs of a few layers while the rest of K varies by a few units: a q8_0 block's scale
    follows the constant and the varying part loses most of its bits (ppl_text.txt -c 256,
    qwen2.5-coder-0.5b, q8_0 K: +1.11% perplexity over f16 K as stored by llama.cpp, -0.5% with
    the shift). llama.cpp's q8_0 K cache stores K unshifted, so this is an edge deviation; the
    f16 and f32 caches are not shifted and stay equal to llama.cpp's.
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


def _k_rotation(head_dim: int) -> int:
    """The Hadamard size llama.cpp rotates Q and K by for a quantized K cache: the largest power
    of two from 64 up that divides head_dim (llama_kv_cache::build_input_k_rot)."""
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def _batch_positions(cache: KVCache, T: int, seq_ids):
    """(seq_ids int32[T], positions int32[T], sequences int64[n] in batch order, their row
    counts int64[n]) of a batch whose rows continue their sequences in ``cache`` (see
    Transformer.forward)."""
    if seq_ids is None:
        p0 = int(cache.pos[0])
        if p0 + T > cache.n_ctx:
            raise ValueError(f"context full: {p0} + {T} tokens exceed n_ctx = {cache.n_ctx}")
        return np.zeros(T, np.int32), np.arange(p0, p0 + T, dtype=np.int32), np.array([0]), np.array([T])
    seq_ids = np.asarray(seq_ids)
    if seq_ids.shape != (T,) or seq_ids.dtype.kind not in "iu":
        raise ValueError(f"seq_ids must be {T} integers, one per token")
    if seq_ids.min() < 0 or seq_ids.max() >= cache.n_seq:
        raise ValueError(f"sequence id out of range [0, {cache.n_seq})")
    seq_ids = seq_ids.astype(np.int32)
    starts = np.flatnonzero(np.r_[True, seq_ids[1:] != seq_ids[:-1]])      # first row of each run
    runs = seq_ids[starts]
    if len(np.unique(runs)) != len(runs):
        raise ValueError("the rows of one sequence must be consecutive in a batch")
    lengths = np.diff(np.r_[starts, T])
    ends = cache.pos[runs] + lengths
    if (ends > cache.n_ctx).any():
        s = int(runs[np.argmax(ends > cache.n_ctx)])
        raise ValueError(f"context full: sequence {s} at {int(cache.pos[s])} + "
                         f"{int(lengths[runs == s][0])} tokens exceeds n_ctx = {cache.n_ctx}")
    positions = (np.arange(T) - np.repeat(starts, lengths) + np.repeat(cache.pos[runs], lengths)).astype(np.int32)
    return seq_ids, positions, runs.astype(np.int64), lengths
