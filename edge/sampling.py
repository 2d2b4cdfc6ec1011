"""Token sampling with llama.cpp's default sampler chain.

The chain mirrors ``common_sampler_init`` (llama.cpp common/sampling.cpp) with the default
sampler order, each step mirroring its ``llama_sampler_*_apply`` in src/llama-sampling.cpp:

1. logit_bias          ``logit += bias[token]`` (a bias of -inf bans the token)
2. penalties           over the distinct tokens of the last ``repeat_last_n`` history tokens:
                       ``logit /= repeat_penalty`` if ``logit > 0`` else ``logit *= repeat_penalty``,
                       then ``logit -= count * frequency_penalty + presence_penalty``
3. mask stage          the request's logits processors, in order: ``logits = p(history, logits)``
                       (edge's, not llama.cpp's: where mlx-lm's logits_processors act; a
                       grammar or a :class:`TokenMask` bans tokens by setting them to -inf)
4. top_k               keep the k largest logits (0 = off)
5. top_p               softmax over what is left; keep the smallest prefix, largest first, whose
                       cumulative probability is >= top_p (1 = off; 0 keeps the best token)
6. min_p               keep logits >= max_logit + log(min_p) (0 = off)
7. temperature         ``logit /= temperature``
8. infill (opt-in)     llama.cpp's infill sampler (:func:`infill_apply`) on what is left, when
                       ``infill`` is set: the place it takes when "infill" ends llama-server's
                       ``samplers`` list, as llama.vscode and llama.vim send it
9. dist                draw from the softmax of what is left

``temperature <= 0`` is greedy: the exact argmax after steps 1-3 (ties go to the lowest id), with
infill on too (llama.cpp's temperature 0 leaves one finite logit, and infill keeps that token).
Ties elsewhere are broken towards the lowest token id, so results do not depend on sort
stability. Steps 1-3 run in the logits' dtype (float32, as llama.cpp); probabilities are
float64. The random stream is a numpy ``Generator`` (PCG64) seeded from ``seed``, so draws are
reproducible per seed but differ from llama.cpp's mt19937 stream.

Cost on V = 262,144: one O(V) selection (``np.partition``) for top_k and O(k log k) sorting;
with top_k off, top_p sorts only a growing prefix (256, 4096, ... tokens) as llama.cpp does.
"""
from __future__ import annotations

import math
import secrets
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

import numpy as np

TOP_P_FIRST_PREFIX = 256  # tokens sorted first by top_p when top_k is off; grows x16

LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]
"""The mask stage's processors: ``(history, logits float[V]) -> logits float[V]``; ``logits``
is the sampler's own copy (a processor may change it in place and return it)."""


class SamplingError(ValueError):
    """The logits or history cannot be sampled from (NaN, no finite logit, bad token id)."""


class InvalidParameter(ValueError):
    """A SamplingParams field out of range: ``param`` is the field's name (OpenAI's parameter
    name where one exists), ``rule`` what it must be, ``value`` what it was."""

    def __init__(self, param: str, rule: str, value):
        super().__init__(f"{param} must be {rule}, got {value!r}")
        self.param, self.rule, self.value = param, rule, value


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters; names and defaults are llama.cpp's (``common_params_sampling``).

    Fields:
        temperature: >= 0; 0 = greedy (argmax).
        top_k: 0 or less = off (as llama.cpp).
        top_p: in [0, 1]; 1 = off.
        min_p: in [0, 1]; 0 = off.
        repeat_penalty: > 0; 1 = off.
        repeat_last_n: >= -1; how many of the last history tokens are penalized
            (0 = off, -1 = the whole history).
        presence_penalty, frequency_penalty: finite; 0 = off (negative values reward repeats).
        seed: None (a random seed) or an int >= 0.
        logit_bias: {token id (int >= 0): bias (finite float, or -inf to ban)}; stored read-only.
        infill: llama.cpp's infill sampler after temperature (module docstring, step 8); the
            :class:`Sampler` then needs the model's :class:`InfillVocab`.

    Raises:
        InvalidParameter (a ValueError): naming the field, when a value is of the wrong type or
            out of range.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    infill: bool = False

    def __post_init__(self):
        def check(name: str, ok: bool, rule: str) -> None:
            if not ok:
                raise InvalidParameter(name, rule, getattr(self, name))

        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            check(name, _is_real(value) and math.isfinite(value), "a finite number")
        for name in ("top_k", "repeat_last_n"):
            check(name, _is_int(getattr(self, name)), "an integer")
        check("temperature", self.temperature >= 0, ">= 0")
        check("top_p", 0 <= self.top_p <= 1, "in [0, 1]")
        check("min_p", 0 <= self.min_p <= 1, "in [0, 1]")
        check("repeat_penalty", self.repeat_penalty > 0, "> 0 (1 = off)")
        check("repeat_last_n", self.repeat_last_n >= -1, ">= -1 (0 = off, -1 = whole history)")
        check("seed", self.seed is None or (_is_int(self.seed) and self.seed >= 0),
              "None or an integer >= 0")
        check("logit_bias", isinstance(self.logit_bias, Mapping), "a mapping token id -> bias")
        check("infill", isinstance(self.infill, (bool, np.bool_)), "a bool")
        for token, bias in self.logit_bias.items():
            if not (_is_int(token) and token >= 0):
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not (_is_real(bias) and (math.isfinite(bias) or bias == -math.inf)):
                raise ValueError(f"logit_bias[{token}] must be a finite number or -inf, got {bias!r}")
        frozen = MappingProxyType({int(t): float(b) for t, b in self.logit_bias.items()})
        object.__setattr__(self, "logit_bias", frozen)


def _top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the (at most) k largest values that are not -inf, largest first, ties to the
    lower index. O(n) selection plus an O(k log k) sort (of more than k values only when many
    values tie with the k-th largest).

    Shapes: values float[n] (no NaN) -> int64[<= k]
    """
    n = values.shape[0]
    if k <= 0:
        return np.empty(0, np.int64)
    if k < n:
        kth = np.partition(values, n - k)[n - k]  # the k-th largest value
        candidates = np.flatnonzero(values >= kth) if kth > -np.inf else np.flatnonzero(values > -np.inf)
    else:
        candidates = np.flatnonzero(values > -np.inf)
    order = np.argsort(-values[candidates], kind="stable")[:k]
    return candidates[order]


def _softmax(values: np.ndarray) -> np.ndarray:
    """float[n] logits (max finite) -> float64[n] probabilities."""
    weights = np.exp(values.astype(np.float64) - float(values.max()))
    return weights / weights.sum()


def _top_p_prefix(probs: np.ndarray, p: float, is_sorted: bool) -> np.ndarray:
    """Positions (largest first) of the smallest prefix of ``probs`` whose sum is >= p
    (llama_sampler_top_p_apply with min_keep 0; all positions if rounding keeps it below p).

    Unsorted input is sorted only as far as needed: the top 256, then 16x more, and so on.
    """
    n = probs.shape[0]
    m = n if is_sorted else min(n, TOP_P_FIRST_PREFIX)
    while True:
        order = np.arange(m) if is_sorted else _top_indices(probs, m)
        cut = int(np.searchsorted(np.cumsum(probs[order]), p))  # first i with cumsum[i] >= p
        if cut < order.shape[0] or m == n:
            return order[:cut + 1]
        m = min(n, m * 16)


INFILL_MIN_P = np.float32(0.2)   # llama_sampler_infill_apply: text tokens below this are dropped


class InfillVocab:
    """What llama.cpp's infill sampler asks of a vocabulary: each token's piece (its bytes with
    special tokens rendered empty), the end-of-generation set and the EOT token (EOS without one).

    Pieces are looked up once per token and kept, so a vocabulary pays for a piece once, not
    once per step. Build one per tokenizer with :meth:`of`.

    Args:
        piece: token id -> bytes (llama.cpp ``token_to_piece(id, lstrip 0, special false)``).
        eog_ids: the end-of-generation token ids (``llama_vocab_is_eog``).
        eot_id: ``llama_vocab_eot``, or ``llama_vocab_eos`` when the vocabulary has no EOT, or None.
    """

    _by_tokenizer: "weakref.WeakKeyDictionary[object, InfillVocab]" = weakref.WeakKeyDictionary()

    def __init__(self, piece: Callable[[int], bytes], eog_ids: Iterable[int], eot_id: int | None):
        self._piece = piece
        self._pieces: dict[int, bytes] = {}
        self.eog_ids = frozenset(int(t) for t in eog_ids)
        self.eot_id = None if eot_id is None else int(eot_id)
        self._eog_sorted = np.array(sorted(self.eog_ids), np.int64)

    @classmethod
    def of(cls, tokenizer) -> InfillVocab:
        """The InfillVocab of an edge.tokenizer.Tokenizer, made once per tokenizer."""
        vocab = cls._by_tokenizer.get(tokenizer)
        if vocab is None:
            eot = tokenizer.special_ids.get("eot")
            vocab = cls(lambda t: tokenizer.token_to_piece(t, special=False), tokenizer.eog_ids,
                        eot if eot is not None else tokenizer.eos_id)
            cls._by_tokenizer[tokenizer] = vocab
        return vocab

    def is_eog(self, token_ids: np.ndarray) -> np.ndarray:
        """int[n] token ids -> bool[n]: which end generation."""
        return np.isin(token_ids, self._eog_sorted)

    def piece(self, token_id: int) -> bytes:
        """The token's piece (cached)."""
        raw = self._pieces.get(token_id)
        if raw is None:
            raw = self._pieces[token_id] = bytes(self._piece(token_id))
        return raw


def _sum32(values: np.ndarray) -> np.float32:
    """float32[n] -> their float32 sum added left to right (a C loop's ``sum += x``)."""
    return np.add.accumulate(values, dtype=np.float32)[-1] if values.shape[0] else np.float32(0)


def _merge_prefixes(pieces: list[bytes], p: np.ndarray, alive: np.ndarray) -> None:
    """llama_sampler_infill_apply's prefix merge, in place: for i0, then i1, in candidate order,
    when piece i0 is a non-empty prefix of piece i1 the less likely of the two (i0 on a tie)
    gives its probability to the other and dies. Only related pairs are visited (found by
    sorting the pieces), in llama.cpp's order, which does not change the result: an unrelated
    pair does nothing, and llama.cpp's ``break`` on a dead i0 only skips pairs a dead i0
    cannot merge.

    Shapes: pieces n bytes; p float32[n] (changed); alive bool[n] (changed: False = logit -inf).
    """
    n = len(pieces)
    by_piece = sorted(range(n), key=pieces.__getitem__)
    sorted_pieces = [pieces[j] for j in by_piece]
    for i0 in range(n):
        head = pieces[i0]
        if not head:
            continue
        at = bisect_left(sorted_pieces, head)
        stop = at
        while stop < n and sorted_pieces[stop].startswith(head):
            stop += 1
        for i1 in sorted(by_piece[at:stop]):
            if not alive[i0]:
                break
            if i1 == i0 or not alive[i1]:
                continue
            dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
            p[dst] = p[dst] + p[src]
            p[src] = 0
            alive[src] = False


def infill_apply(token_ids: np.ndarray, logits: np.ndarray,
                 vocab: InfillVocab) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's infill sampler (src/llama-sampler.cpp ``llama_sampler_infill_apply``) on the
    candidates left by the samplers before it, in float32 as llama.cpp computes it.

    1. Softmax (candidates sorted by logit, largest first, ties to the lower id). When
       3 * p(EOG) * n > p(text), only the end-of-generation candidates stay, renormalised.
    2. Otherwise tokens whose piece is a prefix of another's are merged (:func:`_merge_prefixes`),
       the merged-away ones getting p 0 and logit -inf.
    3. Text candidates below p 0.2 are dropped (EOG ones stay); if no text candidate is left the
       result is the EOT token alone (EOS without EOT; logit 1, p 1). Else renormalise, drop text
       candidates below 1 / (n_text + 1), renormalise again.

    Args:
        token_ids: int[n] candidate ids (n >= 1); logits: float[n] their logits (no NaN, at least
            one finite).
        vocab: the model's :class:`InfillVocab`.
    Returns:
        (token_ids int64[m], probs float32[m], logits float32[m]): llama.cpp's candidate array
        after the sampler, in its order. A merged-away EOG token stays with p 0 and logit -inf;
        the dist sampler after it draws from the softmax of these logits, not from probs.
        (llama.cpp leaves the lone EOT's p stale; here it is 1.)
    Raises:
        SamplingError: the EOT-only result on a vocabulary with neither EOT nor EOS.

    Cost: O(n log n) plus the related pairs, in Python: about 1 ms on top_k 40's candidates,
    about 2 s on a whole 151,936-token vocabulary (llama.cpp's loop over every pair would take
    hours there); keep a top_k before it.
    """
    ids = np.asarray(token_ids, np.int64)
    x = np.asarray(logits, np.float32)
    order = np.lexsort((ids, -x))                      # largest logit first, ties to the lower id
    ids, x = ids[order], x[order]
    e = np.exp(x - x[0])
    p = e / _sum32(e)
    eog = vocab.is_eog(ids)
    p_eog, p_txt = _sum32(np.where(eog, p, 0)), _sum32(np.where(eog, 0, p))
    if np.float32(3) * p_eog * np.float32(ids.shape[0]) > p_txt:
        return ids[eog], p[eog] / _sum32(p[eog]), x[eog]

    alive = x > -np.inf
    _merge_prefixes([vocab.piece(int(t)) for t in ids], p, alive)
    x = np.where(alive, x, np.float32(-np.inf))

    keep = eog | (p >= INFILL_MIN_P)
    n_text = int(np.count_nonzero(keep & ~eog))
    if n_text == 0:
        if vocab.eot_id is None:
            raise SamplingError("infill: the vocabulary has neither an EOT nor an EOS token")
        return np.array([vocab.eot_id], np.int64), np.ones(1, np.float32), np.ones(1, np.float32)
    ids, p, x, eog = ids[keep], p[keep], x[keep], eog[keep]
    p = p / _sum32(p)
    keep = eog | (p >= np.float32(1.0 / (n_text + 1)))
    ids, p, x = ids[keep], p[keep], x[keep]
    return ids, p / _sum32(p), x


class TokenMask:
    """A logits processor that keeps only the allowed tokens (the others get -inf).

    Args:
        allowed: the allowed token ids (ints >= 0), or a bool[V] mask.
    Raises:
        ValueError: ids that are not integers >= 0, or a mask that is not 1-D bool.
        SamplingError (when called): an id outside the vocabulary, or a mask of another size.
    """

    def __init__(self, allowed):
        arr = np.asarray(allowed)
        if arr.dtype == bool:
            if arr.ndim != 1:
                raise ValueError(f"TokenMask: a mask must be 1-D, got shape {arr.shape}")
            self._mask: np.ndarray | None = arr
            self._ids = np.flatnonzero(arr)
        else:
            if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0)):
                raise ValueError("TokenMask: allowed must be token ids (integers >= 0) or a bool mask")
            self._mask, self._ids = None, arr.astype(np.int64)

    def __call__(self, history: Sequence[int], logits: np.ndarray) -> np.ndarray:
        n_vocab = logits.shape[0]
        if self._mask is not None and self._mask.shape[0] != n_vocab:
            raise SamplingError(f"TokenMask: a mask of {self._mask.shape[0]} tokens for a vocabulary of {n_vocab}")
        if self._mask is None:
            if self._ids.size and int(self._ids.max()) >= n_vocab:
                raise SamplingError(f"TokenMask: token {int(self._ids.max())} is not in the vocabulary "
                                    f"of {n_vocab} tokens")
            self._mask = np.zeros(n_vocab, bool)
            self._mask[self._ids] = True
        logits[~self._mask] = -np.inf
        return logits


class Sampler:
    """Picks the next token from a model's logits with llama.cpp's default chain (module docstring).

    One Sampler holds one request's sampling state: its random stream and its mask stage
    (``processors``). Create one per generation (edge.generate builds it beside the sequence)
    and call :meth:`sample` once per generated token.

    Args:
        params: the :class:`SamplingParams`.
        processors: the mask stage's :data:`LogitsProcessor` callables, applied in order after
            logit_bias and penalties, before top_k (greedy included).
        infill_vocab: the model's :class:`InfillVocab` (``InfillVocab.of(tokenizer)``); needed
            when ``params.infill`` is set, unused otherwise.

    Attributes:
        params: the :class:`SamplingParams`.
        processors: the mask stage (a tuple).
        infill_vocab: as given.
        seed: the seed of the random stream (``params.seed``, or a random 32-bit one).

    Raises:
        ValueError: ``params.infill`` without an ``infill_vocab``.
    """

    def __init__(self, params: SamplingParams, processors: Sequence[LogitsProcessor] = (),
                 infill_vocab: InfillVocab | None = None):
        if params.infill and infill_vocab is None:
            raise ValueError("SamplingParams.infill needs the model's vocabulary: pass infill_vocab "
                             "(InfillVocab.of(tokenizer))")
        self.params = params
        self.processors = tuple(processors)
        self.infill_vocab = infill_vocab
        self.seed = params.seed if params.seed is not None else secrets.randbits(32)
        self._rng = np.random.default_rng(self.seed)
        self._bias_ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
        self._bias_values = np.fromiter(params.logit_bias.values(), np.float64, len(params.logit_bias))

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token id.

        Args:
            logits: float[V] logits of the next token (not modified).
            history: the prompt and generated token ids so far, oldest first (for the penalties).

        Raises:
            SamplingError: logits not a non-empty 1-D float array, NaN or +inf after bias,
                penalties and the mask stage, every logit -inf, or a token id of
                history/logit_bias not in [0, V).
        """
        return self.draw(*self.distribution(logits, history))

    def draw(self, token_ids: np.ndarray, probs: np.ndarray) -> int:
        """One token from a distribution (:meth:`distribution`'s pair: int64[n], float64[n]
        summing to 1) with this sampler's random stream; a single token costs no draw."""
        if token_ids.shape[0] == 1:
            return int(token_ids[0])
        cumulative = np.cumsum(probs)
        pick = np.searchsorted(cumulative, self._rng.random() * cumulative[-1], side="right")
        return int(token_ids[min(int(pick), token_ids.shape[0] - 1)])

    def verify(self, logits: np.ndarray, history: Sequence[int], draft: int,
               q: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[int, bool]:
        """Speculative sampling of one drafted position: keep ``draft`` or replace it, so that
        the token is distributed exactly as :meth:`sample`'s (Leviathan et al. 2023, Chen et
        al. 2023: accept with probability min(1, p(draft) / q(draft)), else draw from
        norm(max(0, p - q))), p being :meth:`distribution` after every stage of the chain.

        Args:
            logits: float[V] after ``history``; history: as :meth:`sample`'s.
            draft: the drafted token id.
            q: the drafter's distribution (token ids int64[m], probs float64[m]) the draft was
                drawn from, or None for a draft chosen deterministically from the history
                (prompt lookup, a greedy draft model): q is then 1 at ``draft``.
        Returns:
            (token, accepted): accepted is True when token is the draft. Greedy (p a single
            token) decides without a draw: the draft is kept exactly when it is the argmax.
        Raises:
            SamplingError: as :meth:`sample`.
        """
        ids, p = self.distribution(logits, history)
        hit = np.flatnonzero(ids == draft)
        p_d = float(p[hit[0]]) if hit.size else 0.0
        if q is None:
            q_ids, q_p, q_d = np.array([draft], np.int64), np.ones(1), 1.0
        else:
            q_ids, q_p = q
            where = np.flatnonzero(q_ids == draft)
            q_d = float(q_p[where[0]]) if where.size else 0.0
        if q_d <= 0.0:              # a draft q never proposes: judge it as a sample from p
            q_d = p_d if p_d > 0 else 1.0
        ratio = p_d / q_d
        if ratio >= 1.0 or (ratio > 0.0 and self._rng.random() < ratio):
            return int(draft), True
        # the residual max(0, p - q), over p's support (where p is 0 the residual is 0)
        dense = np.zeros(max(int(ids.max()), int(q_ids.max())) + 1)
        dense[q_ids] = q_p
        residual = np.maximum(p - dense[ids], 0.0)
        total = residual.sum()
        if not total > 0.0:          # p <= q everywhere yet the draft was refused: only rounding
            return int(draft), True
        keep = residual > 0
        return self.draw(ids[keep], residual[keep] / total), False

    def logprobs(self, logits: np.ndarray, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
        """(log-probability of ``token``, the ``n_top`` most likely tokens with theirs) by the
        raw logits, as :meth:`sample_with_logprobs` reports them."""
        raw = np.asarray(logits)
        peak = float(raw.max())
        log_sum = peak + math.log(float(np.exp(raw.astype(np.float64) - peak).sum()))
        top = _top_indices(raw, n_top)
        return float(raw[token]) - log_sum, [(int(t), float(raw[t]) - log_sum) for t in top]

    def sample_with_logprobs(self, logits: np.ndarray, history: Sequence[int],
                             n_top: int) -> tuple[int, float, list[tuple[int, float]]]:
        """The next token with log-probabilities for OpenAI-style ``logprobs``.

        Log-probabilities are the natural-log softmax of the RAW logits (before logit_bias,
        penalties, truncation and temperature), as llama-server's ``n_probs`` and vLLM's default
        report them; a token the chain made likelier still shows the model's own probability.

        Returns:
            (token, logprob of token, [(token id, logprob)] of the n_top most likely tokens by
            the raw logits, most likely first, ties to the lower id). A logprob is -inf for a
            token whose raw logit is -inf.

        Raises:
            SamplingError: as :meth:`sample`. ValueError: n_top is not an integer >= 0.
        """
        if not (_is_int(n_top) and n_top >= 0):
            raise ValueError(f"n_top must be an integer >= 0, got {n_top!r}")
        token = self.sample(logits, history)
        return (token, *self.logprobs(logits, token, n_top))

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The tokens left after the chain and the probabilities :meth:`sample` draws them with.

        Returns:
            (token_ids int64[n], probs float64[n]), n >= 1, probs summing to 1; token ids are
            largest-first when top_k or top_p is on, in id order otherwise. Greedy gives
            ([argmax], [1.0]).

        Raises:
            SamplingError: as :meth:`sample`.
        """
        params = self.params
        x = self._processed(logits, history)
        if params.temperature <= 0:
            return np.array([np.argmax(x)], np.int64), np.ones(1)
        if 0 < params.top_k < x.shape[0]:
            token_ids, is_sorted = _top_indices(x, params.top_k), True
        else:
            token_ids, is_sorted = np.flatnonzero(x > -np.inf), False
        values = x[token_ids]
        if params.top_p < 1:
            keep = _top_p_prefix(_softmax(values), params.top_p, is_sorted)
            token_ids, values = token_ids[keep], values[keep]
        if params.min_p > 0:
            keep = values >= values.max() + np.log(np.asarray(params.min_p, values.dtype))
            token_ids, values = token_ids[keep], values[keep]
        if params.infill:
            return self._infill_distribution(token_ids, values)
        with np.errstate(over="ignore"):  # a tiny temperature sends non-max logits to -inf
            scaled = (values.astype(np.float64) - float(values.max())) / params.temperature
        weights = np.exp(scaled)
        return token_ids, weights / weights.sum()

    def _infill_distribution(self, token_ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Steps 7-9 with infill on, as llama.cpp's temp_ext, infill and dist samplers run them
        (float32 logits): the infill candidates that keep a finite logit, with the softmax of
        their logits (dist's draw; infill's own merged probabilities only choose the candidates).

        Shapes: token_ids int64[n], values float[n] -> (int64[m], float64[m])."""
        scaled = values.astype(np.float32)
        if self.params.temperature != 1:
            temperature = np.float32(self.params.temperature)
            with np.errstate(over="ignore"):
                divided = scaled / temperature
                if not np.isfinite(divided.max()):  # a tiny temperature (llama.cpp: NaN): shift first
                    divided = (scaled - scaled.max()) / temperature
            scaled = divided
        token_ids, _, scaled = infill_apply(token_ids, scaled, self.infill_vocab)
        live = scaled > -np.inf
        token_ids, scaled = token_ids[live], scaled[live].astype(np.float64)
        weights = np.exp(scaled - scaled.max())
        return token_ids, weights / weights.sum()

    def _processed(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """Steps 1-3 on a copy (the input itself when none applies); validates everything."""
        x = np.asarray(logits)
        if x.ndim != 1 or x.shape[0] == 0 or x.dtype.kind != "f":
            raise SamplingError(f"logits must be a non-empty 1-D float array, got shape "
                                f"{x.shape} dtype {x.dtype}")
        n_vocab = x.shape[0]
        window = self._penalty_window(history)
        if self._bias_ids.shape[0] or window is not None or self.processors:
            x = x.copy()
        if self._bias_ids.shape[0]:
            if self._bias_ids.max() >= n_vocab:
                raise SamplingError(f"logit_bias token {int(self._bias_ids.max())} is not in the "
                                    f"vocabulary of {n_vocab} tokens")
            x[self._bias_ids] += self._bias_values.astype(x.dtype)
        if window is not None:
            self._apply_penalties(x, window)
        for processor in self.processors:
            x = np.asarray(processor(history, x))
            if x.shape != (n_vocab,) or x.dtype.kind != "f":
                raise SamplingError(f"logits processor {processor!r} returned shape {x.shape} dtype "
                                    f"{x.dtype}, not {n_vocab} floats")
        peak = x.max()
        if np.isnan(peak) or peak == np.inf:
            raise SamplingError("logits contain NaN or +inf")
        if peak == -np.inf:
            raise SamplingError("every token has logit -inf (all banned); nothing can be sampled")
        return x

    def _penalty_window(self, history: Sequence[int]) -> np.ndarray | None:
        """int64[n] last repeat_last_n tokens of history, or None when penalties are off."""
        p = self.params
        if p.repeat_last_n == 0 or (p.repeat_penalty == 1 and p.frequency_penalty == 0
                                    and p.presence_penalty == 0):
            return None
        window = history if p.repeat_last_n == -1 else history[-p.repeat_last_n:]
        window = np.asarray(window, dtype=np.int64)
        return window if window.shape[0] else None

    def _apply_penalties(self, x: np.ndarray, window: np.ndarray) -> None:
        """llama_sampler_penalties_apply on x in place; shapes: x float[V], window int64[n]."""
        if window.min() < 0 or window.max() >= x.shape[0]:
            bad = window[(window < 0) | (window >= x.shape[0])][0]
            raise SamplingError(f"history token {int(bad)} is not in the vocabulary of "
                                f"{x.shape[0]} tokens")
        tokens, counts = np.unique(window, return_counts=True)
        dtype = x.dtype.type
        repeat = dtype(self.params.repeat_penalty)
        values = x[tokens]
        values = np.where(values <= 0, values * repeat, values / repeat)
        values -= counts.astype(x.dtype) * dtype(self.params.frequency_penalty) + dtype(self.params.presence_penalty)
        x[tokens] = values
