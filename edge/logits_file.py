"""The base-logits file of llama-perplexity's ``--kl-divergence-base`` (llama.cpp
tools/perplexity/perplexity.cpp: perplexity() with params.logits_file, log_softmax(), kl_divergence()).

Layout, little-endian::

    char[8]  "_logits_"
    i32      n_ctx
    i32      n_vocab
    i32      n_chunk
    i32      tokens[n_chunk * n_ctx]        the text's tokens (no BOS substitution)
    then n_chunk * (n_ctx - 1 - n_ctx/2) records, one per scored position in order, each of
    nv = 2 * ((n_vocab + 1) / 2) + 4 uint16:
        f32 scale, f32 min_log_prob         (the first 4 uint16)
        u16 q[n_vocab] (+ one 0 pad if n_vocab is odd)

A record stores the position's log-probs quantized to 16 bits over at most 16 nats below the
top: ``log p_i = scale * q_i + min_log_prob`` (tokens further down read as min_log_prob).
"""
from __future__ import annotations

import contextlib
import struct
from pathlib import Path

import numpy as np

from edge.files import atomic_write

MAGIC = b"_logits_"
HEADER_BYTES = len(MAGIC) + 12
_ROWS = 16   # rows quantized at once: bounds the float temporaries (16 x n_vocab)


class LogitsFileError(ValueError):
    """A base-logits file that is not one, is damaged or truncated, or does not fit the model."""


def record_len(n_vocab: int) -> int:
    """uint16 per scored position: 4 (scale, min_log_prob) + n_vocab rounded up to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def n_scored(n_ctx: int) -> int:
    """Scored positions per chunk, n_ctx - 1 - n_ctx/2 (llama-perplexity's second half)."""
    return n_ctx - 1 - n_ctx // 2


def quantize_log_probs(logits: np.ndarray) -> np.ndarray:
    """Records uint16[N, record_len(n_vocab)] of logits f32[N, n_vocab], as llama-perplexity's
    log_softmax(n_vocab, logits, log_prob, tok): in float32, max = max logit,
    min = max(min logit, max - 16), lse = log(sum in double of expf(l - max)),
    min_log_prob = min - max - lse, scale = (max - min) / 65535,
    q_i = round-half-even((1/scale) * (l_i - min)) if l_i > min else 0 (all 0 when scale is 0)."""
    logits = np.asarray(logits, dtype=np.float32)
    n, n_vocab = logits.shape
    out = np.zeros((n, record_len(n_vocab)), dtype=np.uint16)
    head = out[:, :4].copy().view(np.float32)               # [N, 2]: scale, min_log_prob
    for r in range(0, n, _ROWS):
        x = logits[r : r + _ROWS]
        mx = x.max(axis=1)
        mn = np.maximum(x.min(axis=1), mx - np.float32(16))
        lse = np.log(np.exp(x - mx[:, None]).sum(axis=1, dtype=np.float64)).astype(np.float32)
        head[r : r + _ROWS, 0] = scale = (mx - mn) / np.float32(65535)
        head[r : r + _ROWS, 1] = (mn - mx) - lse
        inv = np.float32(1) / np.where(scale > 0, scale, np.float32(1))
        q = np.rint(inv[:, None] * (x - mn[:, None]))
        q = np.where((x > mn[:, None]) & (scale[:, None] > 0), q, np.float32(0))
        out[r : r + _ROWS, 4 : 4 + n_vocab] = q.astype(np.uint16)
    out[:, :4] = head.view(np.uint16)
    return out


def dequantize_log_probs(records: np.ndarray, n_vocab: int) -> np.ndarray:
    """log p f32[N, n_vocab] of records uint16[N, record_len(n_vocab)]: scale * q + min_log_prob
    in float32 (llama-perplexity's kl_divergence log_softmax)."""
    head = np.ascontiguousarray(records[:, :4]).view(np.float32)
    q = records[:, 4 : 4 + n_vocab].astype(np.float32)
    return q * head[:, :1] + head[:, 1:2]


class BaseLogitsWriter:
    """Writes a base-logits file atomically: a context manager; the file appears at ``path``
    (temporary file, fsync, rename: edge.files.atomic_write) only when the block ends without
    an exception after all ``n_chunk * n_scored(n_ctx)`` records were added; otherwise nothing
    is left.

    ``tokens``: the n_chunk * n_ctx text tokens (int). Raises OSError when it cannot write.
    """

    def __init__(self, path: str | Path, n_ctx: int, n_vocab: int, tokens):
        tokens = np.asarray(tokens, dtype="<i4")
        if n_ctx < 2 or len(tokens) % n_ctx or not len(tokens):
            raise ValueError(f"{len(tokens)} tokens are not whole chunks of n_ctx = {n_ctx}")
        self.path = Path(path)
        self.n_ctx, self.n_vocab = n_ctx, n_vocab
        self.n_chunk = len(tokens) // n_ctx
        self._tokens = tokens
        self._left = self.n_chunk * n_scored(n_ctx)
        self._f = self._stack = None

    def __enter__(self) -> BaseLogitsWriter:
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(atomic_write(self.path))
            self._f = stack.enter_context(open(tmp, "wb"))
            self._f.write(MAGIC + struct.pack("<3i", self.n_ctx, self.n_vocab, self.n_chunk))
            self._f.write(self._tokens.tobytes())
            self._stack = stack.pop_all()
        return self

    def add(self, logits: np.ndarray) -> None:
        """Appends the records of logits f32[N, n_vocab] (the next N scored positions)."""
        if logits.ndim != 2 or logits.shape[1] != self.n_vocab or logits.shape[0] > self._left:
            raise ValueError(f"logits of shape {logits.shape} do not fit: n_vocab {self.n_vocab}, "
                             f"{self._left} positions left")
        self._f.write(quantize_log_probs(logits).astype("<u2", copy=False).tobytes())
        self._left -= logits.shape[0]

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self._left:
            exc = ValueError(f"{self._left} scored positions were not written to {self.path}")
            self._stack.__exit__(ValueError, exc, None)      # the temporary file goes
            raise exc
        self._stack.__exit__(exc_type, exc, tb)


class BaseLogits:
    """A base-logits file opened for reading (header and tokens; records are read a chunk at a time).

    Attributes: path, n_ctx, n_vocab, n_chunk (int), tokens int32[n_chunk * n_ctx].
    Raises LogitsFileError (one line naming the file) when the magic, header, size or tokens are
    wrong; OSError when it cannot be read.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:8] != MAGIC:
            raise LogitsFileError(f"{self.path} is not a base-logits file of --kl-divergence-base "
                                  f"(no '_logits_' header)")
        self.n_ctx, self.n_vocab, self.n_chunk = struct.unpack("<3i", head[8:])
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunk < 1:
            raise LogitsFileError(f"{self.path}: damaged header (n_ctx {self.n_ctx}, n_vocab {self.n_vocab}, "
                                  f"n_chunk {self.n_chunk})")
        self.nv = record_len(self.n_vocab)
        n_tok = self.n_chunk * self.n_ctx
        want = HEADER_BYTES + 4 * n_tok + 2 * self.nv * self.n_chunk * n_scored(self.n_ctx)
        if size != want:
            what = "truncated" if size < want else "damaged"
            raise LogitsFileError(f"{self.path} is {what}: {size:,} bytes, its header (n_ctx {self.n_ctx}, "
                                  f"n_vocab {self.n_vocab}, {self.n_chunk} chunks) means {want:,}")
        self.tokens = np.fromfile(self.path, dtype="<i4", count=n_tok, offset=HEADER_BYTES).astype(np.int32)
        bad = np.flatnonzero((self.tokens < 0) | (self.tokens >= self.n_vocab))
        if len(bad):
            raise LogitsFileError(f"{self.path} is damaged: token {int(self.tokens[bad[0]])} at {int(bad[0])} "
                                  f"is outside the vocabulary of {self.n_vocab}")
        self._records_at = HEADER_BYTES + 4 * n_tok

    def records(self, chunk: int) -> np.ndarray:
        """uint16[n_scored(n_ctx), nv] records of chunk ``chunk`` (0-based; a copy).
        Raises LogitsFileError if a record's scale or min_log_prob is not finite or scale < 0."""
        n = n_scored(self.n_ctx)
        start = self._records_at + 2 * self.nv * n * chunk
        rec = np.fromfile(self.path, dtype="<u2", count=n * self.nv, offset=start)
        if len(rec) != n * self.nv:
            raise LogitsFileError(f"{self.path} is truncated: chunk {chunk + 1} cannot be read")
        rec = rec.reshape(n, self.nv).astype(np.uint16)
        head = np.ascontiguousarray(rec[:, :4]).view(np.float32)
        bad = np.flatnonzero(~np.isfinite(head).all(axis=1) | (head[:, 0] < 0))
        if len(bad):
            raise LogitsFileError(f"{self.path} is damaged: position {int(bad[0])} of chunk {chunk + 1} has "
                                  f"scale {head[bad[0], 0]}, min_log_prob {head[bad[0], 1]}")
        return rec
