"""Embeddings: a text's vector from the model's last hidden state, as llama.cpp computes it.

llama.cpp's embeddings (``llama_get_embeddings_seq`` / ``llama_get_embeddings_ith`` with
``cparams.embeddings``) are the graph's ``t_embd`` tensor: the output norm's result, before
the output projection (``result_norm``; edge.models.transformer.Transformer.hidden). They are
pooled per sequence by ``llm_graph_context::build_pooling`` (src/llama-graph.cpp) as the
context's pooling type says (llama.h ``enum llama_pooling_type``):

- ``none`` (0): no pooling, one vector per token;
- ``mean`` (1): the mean over the sequence's tokens;
- ``cls`` (2): the sequence's first token;
- ``last`` (3): the sequence's last token.

``rank`` (4, rerankers' classification head) is not served. The pooling defaults to the GGUF's
``{arch}.pooling_type`` (llama.cpp's ``LLM_KV_POOLING_TYPE``) and, when the file has none (every
generative model), to ``last``: llama.cpp would leave it ``none`` there, which llama-server's
``/v1/embeddings`` refuses ("Pooling type 'none' is not OAI compatible"), and Ollama's runner
then takes the last token's vector (``GetEmbeddingsIth`` of the last batch row). A causal
model's last token is the one that has seen the whole text.

Vectors are then normalised as llama-server's ``common_embd_normalize`` (common/common.cpp)
does with its ``embd_normalize``: -1 none, 0 max-abs scaled to int16's range (32760), 1
taxicab, 2 euclidean (the default), p > 2 the p-norm.

The computation uses a scratch KV cache of its own (edge.kv.contiguous.KVCache, f16 as
llama.cpp's default; f32 when the engine's cache is f32), so the engine's paged cache, its
running sequences and its prefix cache are not touched. Inputs are packed into forward passes
of at most n_batch tokens as llama-cpp-python's ``Llama.embed`` packs its batches; an input
longer than n_batch runs alone in chunks of n_batch (llama-server would refuse it past its
physical batch; edge takes inputs up to n_ctx). A forward pass is not reentrant: the caller
keeps other forwards of the same model off while it runs (``lock``: the server passes
edge.server.scheduler.STEP_LOCK, taken for each pass, so generation steps interleave).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge.generate import ContextLengthExceeded, forward
from edge.kv.contiguous import KVCache

# llama.h enum llama_pooling_type: the values of the GGUF key {arch}.pooling_type
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
POOLINGS = ("none", "mean", "cls", "last")
DEFAULT_POOLING = "last"          # a file without {arch}.pooling_type (module docstring)
INT16_SCALE = 32760.0             # common_embd_normalize's max-abs range
MAX_SEQS = 256                    # llama.cpp's LLAMA_MAX_SEQ: sequences in one batch

__all__ = ["DEFAULT_POOLING", "POOLINGS", "EmbeddingError", "Embeddings", "default_pooling", "embed",
           "embed_ids", "model_pooling", "normalize_vectors", "tokenize"]


class EmbeddingError(ValueError):
    """A request for embeddings that cannot be served: an empty input, a token id outside the
    vocabulary, an unknown pooling or normalisation, a reranker's pooling. ``param`` names the
    argument ("input", "pooling", "normalize"); ``empty`` is True for an input of no tokens."""

    def __init__(self, message: str, param: str = "input", empty: bool = False):
        super().__init__(message)
        self.param, self.empty = param, empty


@dataclass
class Embeddings:
    """What :func:`embed` returns: ``vectors[i]`` is input i's f32[n_embd] (pooled) or
    f32[n_tokens_i, n_embd] (pooling "none"); ``n_tokens[i]`` its token count (after
    truncation); ``pooling`` the pooling applied."""

    vectors: list[np.ndarray]
    n_tokens: list[int]
    pooling: str

    @property
    def total_tokens(self) -> int:
        return sum(self.n_tokens)


def model_pooling(gguf) -> str | None:
    """The pooling a GGUF file asks for (``{arch}.pooling_type``, llama.cpp's
    LLM_KV_POOLING_TYPE) as a name of POOLING_TYPES, or None when it has none (generative models).

    Raises:
        EmbeddingError: a value llama.cpp does not define (param "pooling").
    """
    key = f"{gguf.get_str('general.architecture', default='')}.pooling_type"
    value = gguf.get_int(key, required=False) if key in gguf.fields else None
    if value is None:
        return None
    if value not in POOLING_TYPES:
        raise EmbeddingError(f"{key} = {value} is not a pooling type llama.cpp knows "
                             f"({', '.join(f'{k} {v}' for k, v in POOLING_TYPES.items())})", "pooling")
    return POOLING_TYPES[value]


def default_pooling(gguf) -> str:
    """The pooling used when none is asked for: the file's (model_pooling), else "last"
    (DEFAULT_POOLING; module docstring). Raises EmbeddingError as model_pooling."""
    return model_pooling(gguf) or DEFAULT_POOLING


def check_pooling(pooling: str) -> str:
    """``pooling`` if it is one of POOLINGS. Raises EmbeddingError (param "pooling") otherwise:
    "rank" (a reranker's) is not served."""
    if pooling not in POOLINGS:
        why = " (rerankers' rank pooling is not served)" if pooling == "rank" else ""
        raise EmbeddingError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}{why}", "pooling")
    return pooling


def normalize_vectors(x: np.ndarray, embd_norm: int = 2) -> np.ndarray:
    """Each row of x f32[..., n] scaled as llama.cpp's ``common_embd_normalize`` (common/common.cpp):
    -1 as it is, 0 max |x| to 32760 (int16's range), 1 taxicab (sum |x|), 2 euclidean, p > 2
    the p-norm; the norm is summed in float64, a zero vector stays zero. Returns a new f32 array.

    Raises:
        EmbeddingError: embd_norm below -1 or not an integer (param "normalize").
    """
    if isinstance(embd_norm, bool) or not isinstance(embd_norm, (int, np.integer)) or embd_norm < -1:
        raise EmbeddingError(f"the normalisation must be an integer >= -1 (-1 none, 0 max-abs int16, 1 taxicab, "
                             f"2 euclidean, p > 2 p-norm), got {embd_norm!r}", "normalize")
    x = np.asarray(x, np.float32)
    if embd_norm == -1:
        return x.copy()
    a = np.abs(x.astype(np.float64))
    if embd_norm == 0:
        s = a.max(axis=-1, keepdims=True) / INT16_SCALE
    elif embd_norm == 1:
        s = a.sum(axis=-1, keepdims=True)
    elif embd_norm == 2:
        s = np.sqrt((a * a).sum(axis=-1, keepdims=True))
    else:
        s = (a ** embd_norm).sum(axis=-1, keepdims=True) ** (1.0 / embd_norm)
    scale = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0).astype(np.float32)
    return x * scale


def tokenize(engine, text: str) -> list[int]:
    """An input text's token ids as llama-server tokenizes embedding inputs
    (``tokenize_input_prompts(vocab, prompt, add_special=true, parse_special=true)``): BOS / EOS
    where the model adds them, special tokens written in the text parsed."""
    return [int(t) for t in engine.tokenizer.encode(text, add_special=True, parse_special=True)]


def _as_inputs(inputs) -> list:
    """inputs as a list of texts / token lists: a str or a flat sequence of ints is one input."""
    if isinstance(inputs, (str, bytes)):
        return [inputs]
    inputs = list(inputs)
    if inputs and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in inputs):
        return [inputs]
    return inputs


def embed(engine, inputs, pooling: str | None = None, normalize: int = 2, truncate: bool = False,
          lock=None) -> Embeddings:
    """Embeddings of ``inputs`` on ``engine`` (edge.engine.Engine), as llama.cpp computes them.

    Args:
        inputs: a text, a token list (ints), or a list of texts and token lists. Texts are
            tokenized as llama-server does (:func:`tokenize`); token lists are taken as given.
        pooling: "none", "mean", "cls", "last", or None for the model's (default_pooling).
        normalize: common_embd_normalize's embd_normalize (:func:`normalize_vectors`), applied to each
            pooled vector, or to each token's vector with pooling "none".
        truncate: cut an input longer than the engine's n_ctx to its first n_ctx tokens
            (Ollama's truncate) instead of raising.
        lock: a context manager taken around each forward pass (None: none).
    Returns:
        Embeddings (vectors f32[n_embd] each, f32[n_tokens, n_embd] for "none").
    Raises:
        EmbeddingError: no inputs, an empty input, a token id outside the vocabulary, a bad
            pooling or normalize.
        ContextLengthExceeded: an input longer than n_ctx (without truncate).
    Source: llama.cpp's llama_decode with cparams.embeddings, build_pooling, common_embd_normalize.
    """
    pooling = check_pooling(pooling if pooling is not None else default_pooling(engine.gguf))
    items = _as_inputs(inputs)
    if not items:
        raise EmbeddingError("no input was given")
    seqs = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = tokenize(engine, item)
        elif isinstance(item, (list, tuple, np.ndarray)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in item):
            ids = [int(t) for t in item]
        else:
            raise EmbeddingError(f"input {i} is neither a text nor a list of token ids")
        if truncate:
            ids = ids[: engine.n_ctx]
        seqs.append(ids)
    vectors = embed_ids(engine, seqs, pooling, normalize, lock)
    return Embeddings(vectors, [len(s) for s in seqs], pooling)


def embed_ids(engine, seqs: Sequence[Sequence[int]], pooling: str, normalize: int = 2, lock=None) -> list[np.ndarray]:
    """The embeddings of token sequences: one f32[n_embd] per sequence (f32[n_tokens, n_embd]
    for pooling "none"), normalised (:func:`normalize_vectors`). Arguments and errors as :func:`embed`
    (the sequences are checked whole before any forward pass)."""
    check_pooling(pooling)
    normalize_vectors(np.zeros((1, 1), np.float32), normalize)    # a bad value fails before any work
    args = engine.model.args
    seqs = [list(s) for s in seqs]
    if not seqs:
        raise EmbeddingError("no input was given")
    for i, s in enumerate(seqs):
        if not s:
            raise EmbeddingError(f"input {i} has no tokens" if len(seqs) > 1 else "the input has no tokens",
                                 empty=True)
        if len(s) > engine.n_ctx:
            raise ContextLengthExceeded(len(s), engine.n_ctx)
        lo, hi = min(s), max(s)
        if lo < 0 or hi >= args.n_vocab:
            raise EmbeddingError(f"input {i}: token {lo if lo < 0 else hi} is not in the vocabulary "
                                 f"(0..{args.n_vocab - 1})")
    lock = lock if lock is not None else contextlib.nullcontext()
    kv_type = "f32" if getattr(engine, "cache_type_k", "f16") == "f32" else "f16"
    n_batch = max(1, int(engine.n_batch))
    out: list[np.ndarray | None] = [None] * len(seqs)
    for group in _groups([len(s) for s in seqs], n_batch):
        pooled = _run_group(engine, [seqs[i] for i in group], pooling, n_batch, kv_type, lock)
        for i, v in zip(group, pooled):
            out[i] = normalize_vectors(v, normalize)
    return out


def _groups(lengths: list[int], n_batch: int, max_seqs: int = MAX_SEQS) -> list[list[int]]:
    """Indices of the sequences in forward passes of at most n_batch tokens and max_seqs
    sequences, in order (as llama-cpp-python's Llama.embed fills its batches: n_seq_max =
    min(n_batch, llama_max_parallel_sequences())); a sequence longer than n_batch alone."""
    groups, cur, n = [], [], 0
    max_seqs = max(1, min(max_seqs, n_batch))
    for i, length in enumerate(lengths):
        if cur and (n + length > n_batch or length > n_batch or len(cur) >= max_seqs):
            groups.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += length
    if cur:
        groups.append(cur)
    return groups


def _run_group(engine, seqs: list[list[int]], pooling: str, n_batch: int, kv_type: str, lock) -> list[np.ndarray]:
    """Forward the sequences of one group into a scratch KV cache (one slot each) in passes of
    at most n_batch rows, and pool each one's hidden states (raw, not normalised)."""
    model = engine.model
    cache = KVCache(model.args, max(len(s) for s in seqs), len(seqs), kv_type)
    n_embd = model.args.n_embd
    parts: list[list[np.ndarray]] = [[] for _ in seqs]
    # the passes: (slot, start, stop) runs; a group of several sequences is one pass
    if len(seqs) == 1:
        passes = [[(0, a, min(a + n_batch, len(seqs[0])))] for a in range(0, len(seqs[0]), n_batch)]
    else:
        passes = [[(s, 0, len(seq)) for s, seq in enumerate(seqs)]]
    for runs in passes:
        tokens, seq_ids, rows, owners = [], [], [], []
        for s, a, b in runs:
            base = len(tokens)
            tokens.extend(seqs[s][a:b])
            seq_ids.extend([s] * (b - a))
            if pooling in ("none", "mean"):
                wanted = range(b - a)
            elif pooling == "cls":
                wanted = [0] if a == 0 else []
            else:                                       # last
                wanted = [b - a - 1] if b == len(seqs[s]) else []
            rows.extend(base + r for r in wanted)
            owners.extend([s] * len(wanted))
        with lock:
            h = forward(model, np.asarray(tokens, np.int64), cache, engine.threads,
                        logits_rows=np.asarray(rows, np.int64), seq_ids=np.asarray(seq_ids, np.int64),
                        hidden=True)
        owners_a = np.asarray(owners, np.int64)
        for s in {s for s, _, _ in runs}:
            parts[s].append(h[owners_a == s])
    pooled = []
    for s in range(len(seqs)):
        rows_s = np.concatenate(parts[s]) if parts[s] else np.empty((0, n_embd), np.float32)
        if pooling == "none":
            pooled.append(rows_s)
        elif pooling == "mean":        # build_pooling: ggml_mul_mat(x^T, 1/n) in f32
            pooled.append((rows_s.astype(np.float64).sum(axis=0) / len(seqs[s])).astype(np.float32))
        else:
            pooled.append(rows_s[0].copy())
    return pooled
