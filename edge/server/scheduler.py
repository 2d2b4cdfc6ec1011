"""Continuous batching: one thread owns the model and serves every request at once.

Each step runs ONE forward pass (edge.generate.GenerationLoop.step) over a batch made of one
decode row for every running sequence that has sampled a token, plus prefill chunks of newly
admitted prompts (up to ``n_batch`` rows in all), samples the next token of every sequence
whose logits the step produced, and retires the finished ones (the loop's finish rules:
end-of-generation token, stop string, max_tokens, or the context full). Waiting requests are
admitted, oldest first, while a sequence slot is free and the KV pool can hold their prompt;
the prefix cache is shared, so a prompt that starts like an earlier one (a system prompt, the
previous turn) reuses its KV blocks.

The model runs in batch-invariant mode (Transformer.set_batch_invariant): a sequence's
logits do not depend on which other sequences share its steps, so a request's text is the
same as when it is served alone.

Events go to each request's ``emit`` callback, called on the scheduler thread (the server
forwards them to its event loop): :class:`Delta` for released text, then exactly one
:class:`Finished` (or :class:`Failed`).
"""
from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edge.generate import ContextLengthExceeded, Limits, Rows, Sampled, Sequence
from edge.kv.blocks import NoFreeBlocks
from edge.kv.cache import KVNoSpace, NoFreeSlot
from edge.sampling import LogitsProcessor, SamplingParams
from edge.threads import use_threads


class QueueFull(RuntimeError):
    """More requests are waiting than --max-queue allows."""


@dataclass
class TokenLogprob:
    """One generated token with its log-probability and the n most likely alternatives
    (natural log of the softmax of the raw logits; see Sampler.sample_with_logprobs)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """Text released by a step (may be empty when only logprobs move), and the logprobs of the
    tokens whose text is now wholly released (when the request asked for logprobs)."""

    text: str
    logprobs: list[TokenLogprob]


@dataclass
class Finished:
    """The end of a request. finish_reason: "stop" (end-of-generation token or stop string)
    or "length" (max_tokens or the context full). Token counts as OpenAI's usage.
    stop_sequence: the stop string that ended the text (None: another reason). Timings in
    seconds from the request's submission (see the properties for Ollama's durations)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stop_sequence: str | None = None
    # timings (not part of equality: two runs of one request finish alike)
    ttft: float | None = field(default=None, compare=False)         # seconds from submit to the first token
    queue_wait: float | None = field(default=None, compare=False)   # seconds from submit to admission
    duration: float | None = field(default=None, compare=False)     # seconds from submit to the end

    @property
    def prompt_seconds(self) -> float:
        """Seconds from admission (a slot and KV blocks given) to the first token (Ollama's
        prompt_eval_duration)."""
        return max(0.0, (self.ttft or 0.0) - (self.queue_wait or 0.0))

    @property
    def generation_seconds(self) -> float:
        """Seconds from the first token to the last (Ollama's eval_duration)."""
        return max(0.0, (self.duration or 0.0) - (self.ttft or 0.0))

    def timings(self, predicted_n: int | None = None) -> dict:
        """llama-server's ``timings``: cache_n (prompt tokens the prefix cache held), prompt_n
        (prompt tokens computed), prompt_ms (admission to the first token), predicted_n (tokens
        generated; ``predicted_n`` overrides completion_tokens), predicted_ms (first token to
        last), and the per-token and per-second rates of both (0 where a count or a time is 0)."""
        prompt_n = max(0, self.prompt_tokens - self.cached_tokens)
        prompt_ms = self.prompt_seconds * 1e3
        n = self.completion_tokens if predicted_n is None else predicted_n
        predicted_ms = self.generation_seconds * 1e3
        return {"cache_n": self.cached_tokens,
                "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / n if n else 0.0,
                "predicted_per_second": 1e3 * n / predicted_ms if predicted_ms > 0 else 0.0}


@dataclass
class Progress:
    """Prompt processing of a request that asked for it (Request.progress), after each step that
    computed some of its prompt: prompt tokens in all, those the prefix cache held, those whose
    K/V is computed now (the cached ones included) and seconds since its admission
    (llama-server's ``prompt_progress``: total, cache, processed, time_ms)."""

    total: int
    cache: int
    processed: int
    seconds: float


@dataclass
class SlotRecord:
    """What a sequence slot last held (Scheduler.last, for llama-server's /slots): the request
    it served (None after a /slots restore), its prompt, its tokens (the prompt, then the
    generated ones), the prompt tokens the prefix cache held and the tokens whose K/V was
    computed when it ended."""

    req: "Request | None"
    prompt_ids: list[int]
    tokens: list[int]
    n_cached: int
    n_computed: int


@dataclass
class Failed:
    """The request could not be completed; ``message`` says why. ``status`` and ``code``: the
    HTTP status and error code the client gets (500 internal_error for a bug, 503
    insufficient_storage when the KV cache's file system is full)."""

    message: str
    status: int = 500
    code: str = "internal_error"


@dataclass(eq=False)
class Request:
    """One generation request.

    prompt_ids: the prompt's token ids (1 <= len < n_ctx). max_tokens: >= 1, or None (until
    the context is full). stop: stop strings. logprobs: None (off) or the number of top
    alternatives (0..20). processors: the sampler's mask stage (edge.sampling.LogitsProcessor).
    emit: called with each event, on the scheduler thread.
    """

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[object], None]
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    processors: list[LogitsProcessor] = field(default_factory=list)
    speculative: dict = field(default_factory=dict)   # n_max / n_min / p_min: this request's drafts
    cancelled: bool = False
    progress: bool = False         # emit Progress events while its prompt is computed
    slot: int | None = None        # the KV cache sequence slot it got (set at admission)
    n_cached: int = 0              # prompt tokens the prefix cache held (set at admission)
    t_submit: float = 0.0
    t_admit: float | None = None
    t_first: float | None = None


@dataclass(eq=False)
class _Seq:
    req: Request
    gen: Sequence               # the loop's sequence: slot, tokens, sampler, text, limits
    t_last: float = 0.0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    done: bool = False


@dataclass
class SchedulerStats:
    """Counters and gauges for /metrics (cumulative counts since start)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    requests_finished: int = 0
    draft_tokens: int = 0             # speculative decoding: drafted tokens verified
    draft_accepted_tokens: int = 0    # and kept


# one forward pass at a time across the server's schedulers (one per loaded model): they share
# the cores, and numba's workqueue threading layer must not be entered from two threads at once
STEP_LOCK = threading.Lock()


class Scheduler:
    """Serves generation requests on ``engine`` with continuous batching (module docstring).

    Args:
        engine: an Engine whose n_seq is the number of sequences served at once.
        max_queue: most requests waiting for a slot; more get QueueFull.
        n_batch: most rows (prompt tokens plus decode rows) per forward pass.
        threads: numba threads for the forward passes (default: numba's setting).
        observe: called as observe(ttft=seconds) at a request's first token,
            observe(tpot=seconds) between later tokens, observe(queue=seconds) at its admission
            and observe(e2e=seconds) at its end (metrics).

    submit() and cancel() may be called from any thread; stop() ends the thread.
    """

    def __init__(self, engine, max_queue: int = 64, n_batch: int = 512, threads: int | None = None,
                 observe: Callable[..., None] | None = None):
        self.engine = engine
        self.model = engine.model
        self.model.set_batch_invariant(True)
        self.kv = engine.kv
        self.loop = engine.loop()
        self.n_ctx = engine.n_ctx
        self.max_queue = max_queue
        self.n_batch = n_batch
        self.threads = threads
        self._observe = observe or (lambda **kw: None)
        self.stats = SchedulerStats()
        self._waiting: deque[Request] = deque()
        self._running: list[_Seq] = []
        self.last: dict[int, SlotRecord] = {}     # slot -> what it last held (llama-server's /slots)
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="edge-scheduler", daemon=True)
        self._thread.start()

    # ---- any thread ----------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue a request. Raises ContextLengthExceeded (the prompt is longer than n_ctx; a
        prompt of n_ctx tokens gets one token), QueueFull, or RuntimeError when stopping."""
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(req.prompt_ids) > self.n_ctx:
            raise ContextLengthExceeded(len(req.prompt_ids), self.n_ctx)
        with self._cv:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            free_slots = max(0, self.kv.n_seq - len(self._running))   # admitted at the next step
            if len(self._waiting) >= self.max_queue + free_slots:
                raise QueueFull(f"the server is busy: {len(self._running)} running, {len(self._waiting)} waiting "
                                f"(-np {self.kv.n_seq}, --max-queue {self.max_queue}); retry later")
            req.t_submit = time.perf_counter()
            self._waiting.append(req)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        """Stop a request (its client went away): its sequence and KV blocks are freed at the
        next step; no further events are emitted."""
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the running and waiting requests, then end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def counts(self) -> tuple[int, int]:
        """(requests running, requests waiting), for /metrics."""
        with self._cv:
            return len(self._running), len(self._waiting)

    def running(self) -> list[tuple[Request, Sequence]]:
        """The admitted requests with their sequences (slot, tokens, n_cached), a snapshot."""
        return [(s.req, s.gen) for s in list(self._running)]

    def busy(self) -> bool:
        with self._cv:
            return bool(self._waiting or self._running)

    # ---- scheduler thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        use_threads(self.threads or None)  # numba's thread count is per calling thread
        while True:
            with self._cv:
                while not (self._waiting or self._running or self._stopping):
                    self._cv.wait()
                if self._stopping and not (self._waiting or self._running):
                    return
            try:
                with STEP_LOCK:
                    self._step()
            except Exception as e:   # a bug must not kill the server: fail the batch, go on
                message = f"internal error: {type(e).__name__}: {e}"
                traceback.print_exc()
                for seq in self._running:
                    self._safe_emit(seq.req, Failed(message))
                    self.loop.free(seq.gen)
                self._running = []

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self._waiting:
                    return
                req = self._waiting[0]
                if req.cancelled:
                    self._waiting.popleft()
                    continue
                try:
                    gen = self.loop.new(req.prompt_ids, req.params, Limits(req.max_tokens, tuple(req.stop)),
                                        req.processors, req.logprobs, text=True)
                    if gen.spec is not None:
                        gen.spec.limits(**req.speculative)
                except ValueError as e:      # this request's fault (a bad limit): it alone fails
                    self._waiting.popleft()
                    self._safe_emit(req, Failed(f"{type(e).__name__}: {e}"))
                    continue
                try:
                    self.loop.admit(gen)
                except (NoFreeSlot, NoFreeBlocks):
                    return
                self._waiting.popleft()
            req.t_admit = time.perf_counter()
            req.slot, req.n_cached = gen.slot, gen.n_cached
            self._observe(queue=req.t_admit - req.t_submit)
            self._running.append(_Seq(req, gen))
            self.stats.prompt_tokens += len(req.prompt_ids)
            self.stats.cached_tokens += gen.n_cached

    def _step(self) -> None:
        for seq in [s for s in self._running if s.req.cancelled]:
            self._retire(seq)
        self._admit()
        if not self._running:
            return
        rows, owners = [], []
        decoding = [s for s in self._running if s.gen.n_generated and not s.done]
        # speculating sequences draft first (their drafts share the step's rows)
        self.loop.propose([s.gen for s in decoding], max(2, self.n_batch // max(1, len(decoding))))
        for seq in decoding:                            # decode rows: one sampled token each (and drafts)
            r = self.loop.rows(seq.gen, self.n_batch)
            if self._reserve(seq, r):
                rows.append(r)
                owners.append(seq)
            else:
                seq.gen.draft = None
        budget = max(self.n_batch - sum(len(r.tokens) for r in rows), 1)
        prefilled = []
        for seq in self._running:                       # prefill chunks, oldest first
            if seq.gen.n_generated or seq.done or budget <= 0:
                continue
            r = self.loop.rows(seq.gen, budget)
            if r is None or not self._reserve(seq, r):
                continue
            rows.append(r)
            budget -= len(r.tokens)
            if seq.req.progress:
                prefilled.append(seq)
            if r.n_logits:
                owners.append(seq)
        if rows:
            self._forward(rows, owners, prefilled)
        for seq in [s for s in self._running if s.req.cancelled or s.done]:
            self._retire(seq)

    def _reserve(self, seq: _Seq, rows: Rows) -> bool:
        """Give KV positions and disk space to seq's rows (GenerationLoop.reserve). When the
        file system is full, the request fails with a 503 (its blocks are freed when it is
        retired; the others go on) and False is returned: it takes no part in the step."""
        try:
            self.loop.reserve(rows)
        except KVNoSpace as e:
            self._safe_emit(seq.req, Failed(str(e), status=503, code="insufficient_storage"))
            seq.done = True
            return False
        return True

    def _forward(self, rows: list[Rows], owners: list[_Seq], prefilled: list[_Seq] = ()) -> None:
        """One step over the rows (owners: the sequences that get logits, in row order), the
        Progress of the ``prefilled`` sequences that asked for it, then sampling of each owner's
        next token."""
        logits = self.loop.step(rows)
        now = time.perf_counter()
        for seq in prefilled:
            gen = seq.gen
            self._safe_emit(seq.req, Progress(len(gen.prompt_ids), gen.n_cached,
                                              min(int(self.kv.pos[gen.slot]), len(gen.prompt_ids)),
                                              now - seq.req.t_admit))
        n_logits = {r.slot: r.n_logits for r in rows}
        at = 0
        for seq in owners:
            n = n_logits[seq.gen.slot]
            block, at = logits[at : at + n], at + n
            if seq.req.cancelled:
                seq.gen.draft = None
                continue
            try:
                self._sample(seq, block, now)
            except Exception as e:   # this request's fault (e.g. its logit_bias): it alone fails
                self._safe_emit(seq.req, Failed(f"{type(e).__name__}: {e}"))
                seq.done = True

    def _sample(self, seq: _Seq, logits: np.ndarray, now: float) -> None:
        """The tokens of seq from its rows' logits f32[n, n_vocab] (one, or a verified draft's)."""
        first = seq.gen.n_generated == 0
        spec = seq.gen.spec
        before = (spec.drafted, spec.accepted) if spec is not None else None
        outs: list[Sampled] = self.loop.sample_rows(seq.gen, logits)
        if spec is not None:
            self.stats.draft_tokens += spec.drafted - before[0]
            self.stats.draft_accepted_tokens += spec.accepted - before[1]
        if first:
            seq.req.t_first = now
            self._observe(ttft=now - seq.req.t_submit)
        else:
            for _ in outs:
                self._observe(tpot=(now - seq.t_last) / len(outs))
        seq.t_last = now
        for out in outs:
            if out.generated:
                self.stats.generated_tokens += 1
                if out.logprob is not None:
                    seq.pending_logprobs.append(TokenLogprob(out.token, out.logprob, out.top))
                self._emit_delta(seq, out.released)
            if out.finish_reason is not None:
                self._finish(seq, out)

    def _emit_delta(self, seq: _Seq, released) -> None:
        lps = []
        if seq.req.logprobs is not None and released.tokens:
            n = len(released.tokens)
            lps, seq.pending_logprobs = seq.pending_logprobs[:n], seq.pending_logprobs[n:]
        if released.text or lps:
            self._safe_emit(seq.req, Delta(released.text, lps))

    def _finish(self, seq: _Seq, out: Sampled) -> None:
        if out.tail is not None:
            self._emit_delta(seq, out.tail)
        gen = seq.gen
        req, now = seq.req, time.perf_counter()
        self._observe(e2e=now - req.t_submit)
        stop = gen.text.matched if gen.text is not None else None
        self._safe_emit(req, Finished(out.finish_reason, len(gen.prompt_ids), gen.n_generated, gen.n_cached, stop,
                                      ttft=None if req.t_first is None else req.t_first - req.t_submit,
                                      queue_wait=None if req.t_admit is None else req.t_admit - req.t_submit,
                                      duration=now - req.t_submit))
        self.stats.requests_finished += 1
        seq.done = True

    def _retire(self, seq: _Seq) -> None:
        gen = seq.gen
        if gen.slot is not None:
            self.last[gen.slot] = SlotRecord(seq.req, gen.prompt_ids, list(gen.tokens), gen.n_cached,
                                             int(self.kv.pos[gen.slot]))
        self.loop.free(seq.gen)
        self._running.remove(seq)


    @staticmethod
    def _safe_emit(req: Request, event) -> None:
        if req.cancelled:
            return
        try:
            req.emit(event)
        except Exception:   # a gone client's loop: the request is as good as cancelled
            req.cancelled = True
