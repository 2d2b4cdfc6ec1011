"""Perplexity by llama-perplexity's method (llama.cpp tools/perplexity, perplexity()).

The text is tokenized without BOS and cut into ``n_chunks = n_tokens // n_ctx`` chunks of
n_ctx tokens. Each chunk is evaluated alone, from an empty KV cache, with its first token
replaced by BOS when the model adds BOS. Only the second half of each chunk is scored: the
logits at positions ``first = n_ctx/2 .. n_ctx - 2`` predict tokens ``first + 1 .. n_ctx - 1``
(n_ctx/2 - 1 tokens per chunk, as llama-perplexity's process_logits call does).
PPL = exp(mean negative log-likelihood); the reported uncertainty is llama-perplexity's
standard error of that mean, propagated through exp.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge.generate import forward
from edge.kv.cache import PagedKVCache
from edge.logits_file import BaseLogitsWriter


@dataclass
class PerplexityResult:
    """Result of :func:`perplexity`. ``nll`` holds the negative log-likelihood (nats) of
    every scored token in order."""

    ppl: float
    stderr: float
    n_ctx: int
    n_chunks: int
    n_text_tokens: int
    nll: list[float] = field(repr=False, default_factory=list)

    @property
    def n_scored(self) -> int:
        return len(self.nll)


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray, rows: int = 16) -> np.ndarray:
    """log p(target) per row, in float64. logits f32[N, V], targets int[N] -> f64[N].
    Computed ``rows`` rows at a time, so the float64 temporaries stay small (rows x V)."""
    out = np.empty(len(targets), np.float64)
    for r in range(0, len(targets), rows):
        x = logits[r : r + rows].astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
        out[r : r + rows] = x[np.arange(len(x)), targets[r : r + rows]] - lse
    return out


def _chunk_cache(engine, chunk: list[int]):
    """A fresh KV cache for one chunk: contiguous f16 (as llama-perplexity's default), or a
    paged one of the engine's KV types holding the chunk as its sequence 0."""
    if engine.cache_type_k == engine.cache_type_v == "f16":
        return engine.model.new_cache(len(chunk))
    cache = PagedKVCache(engine.model.args, len(chunk), 1, engine.block_size, engine.cache_type_k,
                         engine.cache_type_v, storage="anon")
    cache.new_sequence(chunk)
    return cache


def chunk_logits(engine, chunk: list[int]) -> np.ndarray:
    """Logits f32[n_ctx - 1 - n_ctx//2, n_vocab] of one chunk's scored positions.

    ``chunk`` holds the chunk's n_ctx text tokens; it is evaluated alone from an empty KV cache
    with its first token replaced by BOS when the model adds BOS, and the logits at positions
    ``n_ctx//2 .. n_ctx - 2`` are returned (row j predicts ``chunk[n_ctx//2 + j + 1]``), as
    llama-perplexity's perplexity() and kl_divergence() do.
    """
    tok = engine.tokenizer
    n_ctx = len(chunk)
    chunk = list(chunk)
    if tok.add_bos:
        chunk[0] = tok.bos_id
    first = n_ctx // 2
    cache = _chunk_cache(engine, chunk)
    out = np.empty((n_ctx - 1 - first, engine.model.args.n_vocab), np.float32)
    for b in range(0, n_ctx, engine.n_batch):
        end = min(b + engine.n_batch, n_ctx)
        lo, hi = max(first, b), min(n_ctx - 1, end)  # chunk positions whose logits we need
        rows = slice(lo - b, hi - b) if lo < hi else None      # the chunk's last row: unused logits
        logits = forward(engine.model, chunk[b:end], cache, engine.threads, logits_rows=rows)
        if lo < hi:
            out[lo - first : hi - first] = logits
    return out


def perplexity(engine, text: str, n_ctx: int, max_chunks: int = -1,
               on_chunk: Callable[[int, float], None] | None = None,
               save_base: str | Path | None = None) -> PerplexityResult:
    """Perplexity of ``engine``'s model on ``text`` with chunks of ``n_ctx`` tokens.

    ``on_chunk(i, running_ppl)`` is called after each chunk (1-based i). With ``save_base``,
    the scored positions' log-probs are also saved there in llama-perplexity's
    ``--kl-divergence-base`` format (see edge.logits_file), written atomically.
    Raises ValueError if the text has fewer than 2 * n_ctx tokens (as llama-perplexity does)
    or n_ctx is odd or below 4; OSError if the base file cannot be written.
    """
    if n_ctx < 4 or n_ctx % 2:
        raise ValueError(f"n_ctx must be an even number >= 4, got {n_ctx}")
    tokens = engine.tokenizer.encode(text, add_special=False, parse_special=False)
    n_chunks = len(tokens) // n_ctx
    if n_chunks < 2:
        raise ValueError(f"the text has {len(tokens)} tokens; perplexity with n_ctx = {n_ctx} "
                         f"needs at least {2 * n_ctx}")
    if max_chunks > 0:
        n_chunks = min(n_chunks, max_chunks)
    first = n_ctx // 2
    nll: list[float] = []
    with contextlib.ExitStack() as stack:
        writer = None
        if save_base is not None:
            writer = stack.enter_context(BaseLogitsWriter(save_base, n_ctx, engine.model.args.n_vocab,
                                                          tokens[: n_chunks * n_ctx]))
        for c in range(n_chunks):
            chunk = tokens[c * n_ctx : (c + 1) * n_ctx]
            logits = chunk_logits(engine, chunk)
            targets = np.asarray(chunk[first + 1 : n_ctx], dtype=np.int64)
            nll.extend((-_log_softmax_at(logits, targets)).tolist())
            if writer is not None:
                writer.add(logits)
            if on_chunk is not None:
                on_chunk(c + 1, math.exp(float(np.mean(nll))))
    arr = np.asarray(nll)
    mean = float(arr.mean())
    # llama-perplexity: uncertainty of the mean NLL, sqrt((<x^2> - <x>^2) / (N - 1)), times PPL
    var = float((arr**2).mean() - mean**2)
    err_mean = math.sqrt(max(var, 0.0) / (len(arr) - 1)) if len(arr) > 1 else 0.0
    ppl = math.exp(mean)
    return PerplexityResult(ppl=ppl, stderr=ppl * err_mean, n_ctx=n_ctx, n_chunks=n_chunks,
                            n_text_tokens=len(tokens), nll=nll)
