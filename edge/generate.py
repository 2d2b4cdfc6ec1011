"""The generation loop: every forward pass of ``edge run``, ``edge chat``, the server and
``edge bench``, the sampling of each sequence's next token and the rules that end it.

The shape is mlx-lm's generate_step and vLLM's scheduler step: a step computes rows and
returns their logits; sampling and the finish rules act on each sequence that got logits; a
policy above (one sequence for the engine, continuous batching in the server's scheduler, a
fixed batch in the benchmark) decides which rows go into each step.

Rows and steps
    A :class:`Rows` continues one sequence slot of the KV cache at its computed length with
    some tokens: a prefill chunk, one decode token, or (speculative decoding) a token and k
    drafts, and asks for the logits of its last ``n_logits`` rows. :meth:`GenerationLoop.step`
    runs one forward pass over the rows of many sequences (their tokens past what the cache
    knows are appended to it first) and returns the logits in row order. Rows a caller then
    rejects are taken back with PagedKVCache.truncate (a sequence made with a lookahead keeps
    its sliding-window blocks for that).

Sequences
    A :class:`Sequence` is one generation: its slot, its tokens (the prompt, then the generated
    ones), its sampler (the request's random stream and mask stage: edge.sampling.Sampler with
    its logits processors), its text stream (stop strings: edge.textstream.TextStream) and its
    :class:`Limits`. :meth:`GenerationLoop.new` is the one place this per-request state is
    built. :meth:`GenerationLoop.rows` gives a sequence's next rows: its tokens not yet
    computed, the last of them with logits.

Finish rules (:meth:`GenerationLoop.sample`, the one place), in this order:
    1. max_tokens already reached (max_tokens 0): "length", nothing sampled.
    2. an end-of-generation token (unless Limits.eog is off): "stop"; it is not part of the
       generation (not in the tokens, not in the text).
    3. a stop string completed by the token (TextStream): "stop"; the text stops before it.
    4. max_tokens reached with the token: "length".
    5. the context full, the token has no position left (prompt + generated > n_ctx):
       "length", with Sequence.context_full.
    "No limit" is max_tokens None; a sequence with none runs until 2, 3 or 5.

Threads
    :func:`forward` is the one call of the model's forward pass: it applies the caller's
    edge.threads.AdaptiveThreads before the pass and checks it between layers.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass

import numpy as np

from edge.kv.cache import PagedKVCache
from edge.sampling import InfillVocab, LogitsProcessor, Sampler, SamplingParams
from edge.textstream import Released, TextStream


class GenerationStopped(Exception):
    """The caller's stop event was set while the prompt was being computed (no token yet)."""


class ContextLengthExceeded(ValueError):
    """A prompt does not fit the context window. Carries both numbers."""

    def __init__(self, n_prompt: int, n_ctx: int):
        super().__init__(f"the prompt has {n_prompt} tokens but the context size (n_ctx) is {n_ctx}; "
                         "shorten the prompt or raise -c/--ctx-size")
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx


def forward(model, tokens, cache, threads=None, **kw) -> np.ndarray:
    """Transformer.forward of ``tokens`` into ``cache`` under the caller's thread policy.

    Args:
        threads: an edge.threads.AdaptiveThreads (or None): applied before the pass, its check
            called before each layer (``layer_callback``).
        kw: Transformer.forward's logits_rows, seq_ids, prune_last_layer.
    Returns:
        Transformer.forward's logits f32[rows, n_vocab].
    """
    callback = None
    if threads is not None and threads.enabled:
        threads.apply()
        callback = threads.check
    return model.forward(tokens, cache, layer_callback=callback, **kw)


@dataclass(frozen=True)
class Limits:
    """When a sequence ends, besides its end-of-generation tokens (module docstring).

    Fields:
        max_tokens: most generated tokens, an integer >= 0; None = no limit.
        stop: stop strings (the text ends before the first one that appears).
        eog: end at an end-of-generation token (False: decode on through them, as a benchmark).
    Raises:
        ValueError: max_tokens neither None nor an integer >= 0, or a stop that is not a str.
    """

    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    eog: bool = True

    def __post_init__(self):
        m = self.max_tokens
        if m is not None and not (isinstance(m, (int, np.integer)) and not isinstance(m, bool) and m >= 0):
            raise ValueError(f"max_tokens must be None (no limit) or an integer >= 0, got {m!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop strings must be str, got {list(stop)!r}")
        object.__setattr__(self, "stop", stop)


@dataclass(frozen=True)
class Rows:
    """Rows of one step for one sequence slot: ``tokens`` continue the slot at its computed
    length (cache.pos[slot]); the logits of the last ``n_logits`` of them are returned."""

    slot: int
    tokens: Seq[int]
    n_logits: int = 1


@dataclass(eq=False)
class Sequence:
    """One generation (module docstring). Built by GenerationLoop.new; ``slot`` is set when it
    gets its KV cache sequence (GenerationLoop.admit, or the caller's own, e.g. a session)."""

    prompt_ids: list[int]
    tokens: list[int]                 # the prompt, then the generated tokens
    sampler: Sampler
    limits: Limits
    text: TextStream | None           # None: no text wanted and no stop strings
    logprobs: int | None              # None, or the number of top alternatives to report
    lookahead: int = 0
    slot: int | None = None
    n_cached: int = 0                 # prompt tokens whose K/V came from the prefix cache
    logits: np.ndarray | None = None  # the logits after the last computed token, when known
    finish_reason: str | None = None  # "stop" or "length" once finished
    context_full: bool = False        # finished at n_ctx
    spec: object = None               # edge.speculative.SpecState when the sequence speculates
    spec_sampler: Sampler | None = None   # a draft model's sampler (its own random stream)
    draft: object = None              # edge.speculative.Draft to verify in the next step

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)


@dataclass
class Sampled:
    """What GenerationLoop.sample did for one sequence.

    token: the sampled token id (None when rule 1 ended the sequence before sampling);
    generated: whether it is part of the generation (False for an end-of-generation token);
    logprob, top: its log-probability and the top alternatives (Sequence.logprobs asked);
    released: the text the token released (TextStream.push); tail: the text released at the
    finish (TextStream.finish; None when it ended at a stop string or without a text stream);
    finish_reason: "stop", "length" or None (it goes on).
    """

    token: int | None
    generated: bool = False
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    released: Released | None = None
    tail: Released | None = None
    finish_reason: str | None = None


class GenerationLoop:
    """Steps, sampling and finish rules over one model and one KV cache (module docstring).

    Args:
        model: an edge.models Transformer.
        kv: its KV cache: an edge.kv.cache.PagedKVCache (or the contiguous KVCache of
            Transformer.new_cache, for prefill only).
        tokenizer: the model's edge.tokenizer.Tokenizer (end-of-generation tokens, text).
        n_batch: the most rows :meth:`compute` and :meth:`prefill` give one step.
        threads: the caller's edge.threads.AdaptiveThreads, or None.
    """

    def __init__(self, model, kv, tokenizer=None, n_batch: int = 512, threads=None, speculator=None):
        self.model, self.kv, self.tokenizer = model, kv, tokenizer
        self.n_batch = n_batch
        self.threads = threads
        self.speculator = speculator
        self._paged = isinstance(kv, PagedKVCache)

    # ---- sequences -----------------------------------------------------------------------

    def new(self, prompt_ids: Seq[int], params: SamplingParams | None = None, limits: Limits = Limits(),
            processors: Seq[LogitsProcessor] = (), logprobs: int | None = None, text: bool = False,
            lookahead: int = 0) -> Sequence:
        """A new sequence and its per-request state (no KV cache slot yet: :meth:`admit`).

        Args:
            prompt_ids: the prompt's token ids.
            params: sampling parameters (default SamplingParams()); ``infill`` needs the
                loop's tokenizer (ValueError without one).
            limits: max_tokens, stop strings, eog.
            processors: the sampler's mask stage (edge.sampling.LogitsProcessor).
            logprobs: None, or how many top alternatives :meth:`sample` reports with each token.
            text: keep a text stream (released text in Sampled) even without stop strings.
            lookahead: positions the sequence may take back (PagedKVCache.truncate); with a
                speculator, at least its draft_max + 1.
        """
        prompt = [int(t) for t in prompt_ids]
        stream = TextStream(self.tokenizer, limits.stop) if text or limits.stop else None
        spec = self.speculator
        if spec is not None:
            lookahead = max(lookahead, spec.params.draft_max + 1)
        params = params or SamplingParams()
        infill = InfillVocab.of(self.tokenizer) if params.infill and self.tokenizer is not None else None
        seq = Sequence(prompt, list(prompt), Sampler(params, processors, infill), limits,
                       stream, logprobs, lookahead)
        if spec is not None:
            spec.start(seq)
        return seq

    def admit(self, seq: Sequence) -> None:
        """Give ``seq`` a KV cache sequence holding its prompt (the prefix cache's share of it
        counted in seq.n_cached). Raises NoFreeSlot, NoFreeBlocks (nothing changed)."""
        seq.slot, seq.n_cached = self.kv.new_sequence(seq.prompt_ids, lookahead=seq.lookahead)

    def free(self, seq: Sequence) -> None:
        """End ``seq``'s KV cache sequence (its full blocks stay cached) and its drafter's."""
        if seq.spec is not None and self.speculator is not None:
            self.speculator.release(seq)
        if seq.slot is not None:
            self.kv.free(seq.slot)
            seq.slot = None

    def truncate(self, seq: Sequence, n_keep: int) -> None:
        """Take back ``seq``'s tokens from position ``n_keep`` on: in the KV cache
        (PagedKVCache.truncate) and in seq.tokens (text already released stays released).
        Raises ValueError (below the prompt, or see PagedKVCache.truncate), KVNoSpace."""
        if n_keep < len(seq.prompt_ids):
            raise ValueError(f"truncate: n_keep {n_keep} is inside the prompt of {len(seq.prompt_ids)} tokens")
        self.kv.truncate(seq.slot, min(n_keep, self.kv.num_tokens(seq.slot)))
        del seq.tokens[n_keep:]
        seq.logits = None

    def rows(self, seq: Sequence, budget: int) -> Rows | None:
        """``seq``'s next rows: up to ``budget`` of its tokens not yet computed, with logits for
        the last when it is the last known token; None when every token is computed. A
        sequence with a draft (:meth:`propose`) decodes its last token and the drafted tokens
        (as many as the budget leaves), with logits for every row."""
        done = int(self.kv.pos[seq.slot])
        chunk = seq.tokens[done : done + budget]
        if not chunk:
            return None
        if seq.draft is not None:
            if done + 1 == len(seq.tokens) and budget > 1:
                seq.draft.tokens = seq.draft.tokens[: budget - 1]
                if seq.draft.q is not None:
                    seq.draft.q = seq.draft.q[: budget - 1]
                tokens = chunk + seq.draft.tokens
                return Rows(seq.slot, tokens, len(tokens))
            seq.draft = None
        return Rows(seq.slot, chunk, int(done + len(chunk) == len(seq.tokens)))

    def propose(self, seqs: Seq[Sequence], budget: int | None = None) -> None:
        """Let the speculator draft for each sequence of ``seqs`` that speculates and is ready to
        decode (every token but its last computed; not finished): seq.draft is set (or None).
        Drafts stay within n_ctx, max_tokens (one token always comes from the target) and
        ``budget`` (rows of the step per sequence, default n_batch)."""
        spec = self.speculator
        if spec is None:
            return
        budget = self.n_batch if budget is None else budget
        ready, caps = [], []
        for seq in seqs:
            seq.draft = None
            if seq.spec is None or seq.finish_reason is not None or seq.slot is None:
                continue
            if int(self.kv.pos[seq.slot]) + 1 != len(seq.tokens) or seq.n_generated == 0:
                continue
            cap = min(budget - 1, self.kv.n_ctx - len(seq.tokens))
            if seq.limits.max_tokens is not None:
                cap = min(cap, seq.limits.max_tokens - seq.n_generated - 1)
            ready.append(seq)
            caps.append(max(0, cap))
        if ready:
            spec.propose(ready, caps)

    def reserve(self, rows: Rows) -> None:
        """Give the KV cache positions to ``rows``: append the tokens it does not know yet, then
        disk space (PagedKVCache.reserve). Raises ValueError (past n_ctx), NoFreeBlocks,
        KVNoSpace: a scheduler leaves the rows out of the step."""
        self._append(rows)
        self.kv.reserve(rows.slot, len(rows.tokens))

    # ---- steps ---------------------------------------------------------------------------

    def step(self, rows: Seq[Rows]) -> np.ndarray:
        """One forward pass over ``rows`` (the rows of one slot at most once).

        Returns:
            logits f32[sum of n_logits, n_vocab]: each Rows' last n_logits rows, in order.
        Raises:
            ValueError: rows past n_ctx, bad tokens; NoFreeBlocks, KVNoSpace (from the cache).
        """
        tokens: list[int] = []
        seq_ids: list[int] = []
        logits_rows: list[int] = []
        for r in rows:
            self._append(r)
            tokens.extend(r.tokens)
            seq_ids.extend([r.slot] * len(r.tokens))
            logits_rows.extend(range(len(tokens) - r.n_logits, len(tokens)))
        return forward(self.model, np.asarray(tokens, np.int64), self.kv, self.threads,
                       logits_rows=np.asarray(logits_rows, np.int64), seq_ids=np.asarray(seq_ids, np.int64))

    def _append(self, rows: Rows) -> None:
        if self._paged:
            known = self.kv.num_tokens(rows.slot)
            new = int(self.kv.pos[rows.slot]) + len(rows.tokens) - known
            if new > 0:
                self.kv.append(rows.slot, list(rows.tokens[len(rows.tokens) - new :]))

    def prefill(self, slot: int, ids: Seq[int], stop=None) -> np.ndarray:
        """Compute ``ids`` after the positions of ``slot``, in steps of n_batch rows; returns the
        last logits f32[n_vocab]. Raises ContextLengthExceeded when they do not fit in n_ctx,
        GenerationStopped when ``stop`` (a threading.Event) is set before a step."""
        n_past = int(self.kv.pos[slot])
        if n_past + len(ids) > self.kv.n_ctx:
            raise ContextLengthExceeded(n_past + len(ids), self.kv.n_ctx)
        logits = None
        for i in range(0, len(ids), self.n_batch):
            if stop is not None and stop.is_set():
                raise GenerationStopped()
            chunk = ids[i : i + self.n_batch]
            logits = self.step([Rows(slot, chunk, int(i + self.n_batch >= len(ids)))])
        return logits[-1]

    def compute(self, seq: Sequence) -> np.ndarray:
        """Compute ``seq``'s tokens not yet computed, n_batch rows a step; returns (and keeps
        as seq.logits) the logits after the last, f32[n_vocab]."""
        seq.logits = self.prefill(seq.slot, seq.tokens[int(self.kv.pos[seq.slot]):])
        return seq.logits

    WARM_UP_MAX_ROWS = 64

    def warm_up(self) -> None:
        """Run prefills of 9 rows (the many-row kernels: 8 rows and up) and of enough rows that
        the element-wise kernels take their parallel paths (kernels_cpu.ops.PARALLEL_MIN
        elements per call), a sampled token and a 1-row decode step each, of throwaway
        sequences of BOS tokens (which no real prompt's cached prefix matches), then free them,
        so that numba has compiled (or loaded from its cache) each path's kernels before a real
        request waits on them. Raises what a step raises (edge.kv.cache.KVNoSpace, NoFreeSlot)."""
        from kernels_cpu.ops import PARALLEL_MIN

        bos = self.tokenizer.bos_id if self.tokenizer is not None else None
        n_par = -(-PARALLEL_MIN // max(1, self.model.args.n_embd)) + 1
        sizes = {9} | ({n_par} if n_par <= min(self.WARM_UP_MAX_ROWS, self.n_batch, self.kv.n_ctx - 2) else set())
        for n in sorted(sizes):     # (a tiny model's element-wise kernels go parallel only in long prompts)
            if n < 2:
                continue
            seq = self.new([int(bos) if bos is not None and bos >= 0 else 0] * n, SamplingParams(),
                           Limits(max_tokens=2, eog=False))
            self.admit(seq)
            try:
                self.sample(seq, self.compute(seq))
                self.reserve(rows := self.rows(seq, 1))
                self.step([rows])
            finally:
                self.free(seq)

    # ---- sampling and the finish rules ---------------------------------------------------

    def sample(self, seq: Sequence, logits: np.ndarray) -> Sampled:
        """Sample ``seq``'s next token from ``logits`` (f32[n_vocab], after its last token) and
        apply the finish rules (module docstring); a generated token is appended to seq.tokens
        (the KV cache gets it with the next step's rows).

        Raises:
            edge.sampling.SamplingError: the logits cannot be sampled (the sequence is unchanged).
        """
        limits = seq.limits
        if limits.max_tokens is not None and seq.n_generated >= limits.max_tokens:
            return self._finish(seq, Sampled(None), "length")
        if seq.logprobs is not None:
            tok, lp, top = seq.sampler.sample_with_logprobs(logits, seq.tokens, seq.logprobs)
            out = Sampled(tok, logprob=lp, top=top)
        else:
            out = Sampled(seq.sampler.sample(logits, seq.tokens))
        return self._take(seq, out)

    def sample_rows(self, seq: Sequence, logits: np.ndarray) -> list[Sampled]:
        """The tokens of ``seq`` from its rows' logits (f32[n, n_vocab]): one sample
        (:meth:`sample`) without a draft; with one (n = 1 + drafted tokens), each drafted token
        verified in turn (Sampler.verify) and taken through the finish rules until one is
        replaced, the sequence finishes, or all are kept and one more is sampled from the last
        row. The KV cache keeps the rows of the kept drafts; the speculator learns the count.

        Raises:
            edge.sampling.SamplingError: as :meth:`sample` (tokens taken before it stand).
        """
        draft, seq.draft = seq.draft, None
        logits = np.asarray(logits)
        if logits.ndim == 1:
            logits = logits[None]
        if draft is None or logits.shape[0] == 1:
            return [self.sample(seq, logits[-1])]
        k = logits.shape[0] - 1
        n_before = len(seq.tokens)
        outs, kept, accepted = [], 0, 0
        try:
            for i in range(k + 1):
                limits = seq.limits
                if limits.max_tokens is not None and seq.n_generated >= limits.max_tokens:
                    outs.append(self._finish(seq, Sampled(None), "length"))
                    break
                if i < k:
                    q = draft.q[i] if draft.q is not None else None
                    tok, ok = seq.sampler.verify(logits[i], seq.tokens, draft.tokens[i], q)
                else:
                    tok, ok = seq.sampler.sample(logits[i], seq.tokens), False
                out = Sampled(tok)
                if seq.logprobs is not None:
                    out.logprob, out.top = seq.sampler.logprobs(logits[i], tok, seq.logprobs)
                out = self._take(seq, out)
                outs.append(out)
                accepted += ok
                kept += ok and out.generated
                if out.finish_reason is not None or not ok:
                    break
        finally:
            n_keep = n_before + kept
            if self._paged and self.kv.num_tokens(seq.slot) > n_keep:
                self.kv.truncate(seq.slot, n_keep)
            seq.logits = np.array(logits[kept])     # after the last token the cache keeps
            if self.speculator is not None and seq.spec is not None:
                self.speculator.update(seq, k, accepted)
        return outs

    def _take(self, seq: Sequence, out: Sampled) -> Sampled:
        """The finish rules 2-5 for a chosen token (module docstring)."""
        limits = seq.limits
        if limits.eog and self.tokenizer.is_eog(out.token):
            return self._finish(seq, out, "stop")
        out.generated = True
        seq.tokens.append(out.token)
        if seq.text is not None:
            out.released = seq.text.push(out.token)
            if out.released.stopped:
                seq.finish_reason = out.finish_reason = "stop"
                return out
        if limits.max_tokens is not None and seq.n_generated >= limits.max_tokens:
            self._finish(seq, out, "length")
        if len(seq.tokens) > self.kv.n_ctx:
            seq.context_full = True
            self._finish(seq, out, "length")
        return out

    def _finish(self, seq: Sequence, out: Sampled, reason: str) -> Sampled:
        if out.finish_reason is None:
            seq.finish_reason = out.finish_reason = reason
            if seq.text is not None:
                out.tail = seq.text.finish()
        return out

    def run(self, seq: Sequence) -> Iterator[Sampled]:
        """Drive one sequence to its end: compute its tokens not yet computed (n_batch rows a
        step; none when seq.logits already holds the logits after its last token), sample,
        apply the finish rules; yields what each sample did, the last one finished. A
        speculating sequence decodes its drafts with its last token (:meth:`propose`,
        :meth:`sample_rows`)."""
        while True:
            logits = seq.logits
            if self.speculator is not None and seq.spec is not None:
                self.propose([seq])
            if seq.draft is not None:
                r = self.rows(seq, self.n_batch)
                outs = self.sample_rows(seq, self.step([r]))
            else:
                if logits is None or int(self.kv.pos[seq.slot]) < len(seq.tokens):
                    logits = self.compute(seq)
                outs = [self.sample(seq, logits)]
            for out in outs:
                yield out
                if out.finish_reason is not None:
                    return

    def advance(self, seqs: Seq[Sequence]) -> list[Sampled]:
        """One step for the unfinished sequences of ``seqs`` (each its next rows, n_batch rows in
        all at most; speculating sequences with their drafts) and the samples of each that got
        logits; returns those samples, in order (several for a sequence whose drafts were kept)."""
        self.propose(seqs, max(1, self.n_batch // max(1, len(seqs))))
        rows, owners, budget = [], [], self.n_batch
        for seq in seqs:
            if seq.finish_reason is not None:
                continue
            r = self.rows(seq, budget)
            if r is not None:
                rows.append(r)
                budget -= len(r.tokens)
                if r.n_logits:
                    owners.append((seq, r.n_logits))
        logits = self.step(rows) if rows else None
        out, at = [], 0
        for seq, n in owners:
            out.extend(self.sample_rows(seq, logits[at : at + n]))
            at += n
        return out
