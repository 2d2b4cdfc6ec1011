"""The decoder-only transformer every architecture is: token embeddings, a stack of blocks,
the output norm and projection; and the forward pass over a KV cache.

An architecture (edge.models.llama, qwen2, gemma3) subclasses :class:`Transformer` with the
tensors it declares (:attr:`~Transformer.TENSORS`, :attr:`~Transformer.LAYER_TENSORS`), its
block (:meth:`~Transformer.build_blocks`) and, where it differs, :meth:`~Transformer.embed`
and :meth:`~Transformer.logits`. Attribute names equal GGUF tensor names (``token_embd``,
``output_norm``; ``output`` is token_embd when the file ties them).
"""
from __future__ import annotations

import numpy as np

from edge.gguf_file import GGUFFile
from edge.kv.contiguous import DEFAULT_TYPE, KVCache
from edge.models.hparams import ModelArgs
from edge.models.layers import Batch, Block, Scratch, rms_norm
from edge.models.weights import ExpertWeights, Tensor, Weight, load_tensors, optional, tensor

# the tensors outside the blocks that every architecture has
EMBEDDING_AND_OUTPUT = [
    tensor("token_embd.weight", "n_embd", "n_vocab"),
    tensor("output_norm.weight", "n_embd"),
    optional("output.weight", "n_embd", "n_vocab"),               # absent: tied to token_embd
]


class Transformer:
    """A decoder-only transformer over GGUF weights (subclassed per architecture).

    Args:
        gf: the model file.
        args: its hyperparameters (held to each other here, then every declared tensor to them).
    Raises GGUFError naming a hyperparameter, or a tensor that is missing, mis-shaped or unused.
    """

    TENSORS: list[Tensor] = EMBEDDING_AND_OUTPUT   # outside the blocks
    LAYER_TENSORS: list[Tensor] = []                # of every block, without "blk.N."

    def __init__(self, gf: GGUFFile, args: ModelArgs):
        args.check(gf)   # every size and index below comes from args, now held to each other
        self.args = args
        self.gguf = gf
        top, layers = load_tensors(gf, args, self.TENSORS, self.LAYER_TENSORS)
        vars(self).update(top)
        if self.output is None:
            self.output = self.token_embd                                  # tied
        self.blocks: list[Block] = self.build_blocks(layers)
        self.scratch = Scratch(max(args.n_embd, args.n_ff, args.n_head * args.head_dim_v, getattr(args, "n_ff_exp", 0)))
        self.batch_invariant = False

    def build_blocks(self, layers: list[dict]) -> list[Block]:
        """The blocks, from each layer's tensors ({attribute: value}, load_tensors)."""
        raise NotImplementedError

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """The input rows of token ids int64[T]: f32[T, n_embd] (ggml_get_rows of token_embd)."""
        return self.token_embd.get_rows(tokens)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Logits f32[R, n_vocab] of the last layer's rows x f32[R, n_embd] (normed in place)."""
        return self.output(rms_norm(x, self.output_norm, self.args.rms_eps, x))

    def hidden(self, x: np.ndarray) -> np.ndarray:
        """The embeddings f32[R, n_embd] of the last layer's rows x f32[R, n_embd]: the output
        norm's result, before the output projection (llama.cpp's ``t_embd``, "result_norm");
        a new array, x is left as it is."""
        return rms_norm(x, self.output_norm, self.args.rms_eps, np.empty_like(x))

    def set_batch_invariant(self, on: bool = True) -> None:
        """With ``on``, every row of a batch is computed with one arithmetic whatever the batch
        (kernels_cpu.matmul's batch_invariant kernels, attention in ggml_vec_dot_f16 order), so
        a token's logits depend only on its sequence, not on the batch or prefill chunking it
        was computed in. The server turns this on: a request's text must not depend on what
        else is being served. Attention and most K-quant matmuls keep llama.cpp's one-row
        arithmetic; Q5_0 / Q8_0 take the GEMV structure and Q6_K the tiled kernel's (faster in
        batches, last bits differ from llama.cpp's VEC_DOT). Default off: llama.cpp's choice
        of kernel per batch size (edge.engine.Engine.batch_invariant, --batch-invariant)."""
        for w in self.weights():
            w.batch_invariant = bool(on)
        self.batch_invariant = bool(on)

    def weights(self) -> list[Weight]:
        """Every matrix the forward multiplies by (token_embd once, also when output is tied;
        each expert of an ExpertWeights)."""
        found = {}
        for owner in [self, *self.blocks]:
            for value in vars(owner).values():
                for w in value.experts if isinstance(value, ExpertWeights) else [value]:
                    if isinstance(w, Weight):
                        found[id(w)] = w
        return list(found.values())

    def set_observer(self, observer=None) -> None:
        """Call ``observer(weight_name, x f32[T, n_in])`` before every matrix product of the
        forward (None: off, the default; the check costs one attribute test per product)."""
        for w in self.weights():
            w.observer = observer

    def new_cache(self, n_ctx: int, n_seq: int = 1, kv_type: str = DEFAULT_TYPE) -> KVCache:
        """An empty contiguous KV cache of n_ctx positions for each of n_seq sequences
        (edge.kv.contiguous.KVCache; kv_type for K and V)."""
        return KVCache(self.args, n_ctx, n_seq, kv_type)

    def forward(self, tokens, cache, logits_rows=None, seq_ids=None, prune_last_layer: bool = True,
                layer_callback=None, hidden: bool = False) -> np.ndarray:
        """Process ``tokens`` (int[T]) and append them to their sequences in ``cache``.

        ``seq_ids`` (int[T], default all 0) gives each row's sequence slot; the rows of one
        sequence must be consecutive and continue it at positions cache.pos[s], cache.pos[s]+1,
        ... So a prefill chunk is (tokens, cache) and one decode step of B sequences is
        (next_tokens[B], cache, seq_ids=[0..B-1]); both kinds of rows may share a batch.
        ``layer_callback`` (default None) is called as layer_callback(il) before layer il (the
        caller's thread policy, edge.threads.AdaptiveThreads.check).

        Returns logits f32[len(rows), n_vocab] for the batch rows ``logits_rows`` (default: the
        last row of each sequence in the batch, in order of appearance; ``slice(None)`` for
        all; no rows: only the K/V are computed, f32[0, n_vocab]). The last layer computes only
        those rows (as llama.cpp's inp_out_ids); ``prune_last_layer=False`` makes it compute
        every row (an importance matrix sees all of them) and still returns only those logits.
        With ``hidden``, those rows' embeddings f32[len(rows), n_embd] instead (:meth:`hidden`:
        the output norm's result, llama.cpp's ``t_embd``; edge.embedding pools them).
        Raises ValueError for an empty batch, a token id outside the vocabulary, a bad or
        interleaved sequence id, or rows that do not fit in n_ctx.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        if T == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.args.n_vocab:
            raise ValueError(f"token id out of range [0, {self.args.n_vocab})")
        seq_ids, positions, runs, lengths = _batch_positions(cache, T, seq_ids)
        x = self.embed(tokens)                                             # [T, n_embd]
        if logits_rows is None:
            logits_rows = np.cumsum(lengths) - 1
        elif not isinstance(logits_rows, slice):
            logits_rows = np.asarray(logits_rows, np.int64)
        b = Batch(cache, seq_ids, positions, self.scratch, self.batch_invariant)
        cache.prepare(runs, lengths)
        last = len(self.blocks) - 1
        for il, blk in enumerate(self.blocks):
            if layer_callback is not None:
                layer_callback(il)
            if il == last and prune_last_layer:
                b.out_rows = logits_rows
            x = blk(x, b)
            if x is None:                                                  # only K/V were wanted
                break
        cache.commit(runs, lengths)
        if x is not None and not prune_last_layer:
            x = x[logits_rows]
        if x is None or x.shape[0] == 0:                                   # no logits asked for
            return np.empty((0, self.args.n_embd if hidden else self.args.n_vocab), np.float32)
        return self.hidden(x) if hidden else self.logits(x)               # [rows, n_embd | n_vocab]


def _batch_positions(cache, T: int, seq_ids):
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
