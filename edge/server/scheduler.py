"""Continuous batching: one thread owns the model and serves every request at once.

Each step runs ONE forward pass over a batch made of one decode row for every running
sequence that has sampled a token, plus prefill chunks of newly admitted prompts (up to
``n_batch`` rows in all), samples the next token of every sequence whose logits the step
produced, and retires the finished ones (end-of-generation token, stop string, max_tokens, or
the context full). Waiting requests are admitted, oldest first, while a sequence slot is free
and the KV pool can hold their prompt; the prefix cache is shared, so a prompt that starts
like an earlier one (a system prompt, the previous turn) reuses its KV blocks.

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

from edge.engine import ContextLengthExceeded
from edge.kv.blocks import NoFreeBlocks
from edge.kv.cache import KVNoSpace, NoFreeSlot
from edge.sampling import Sampler, SamplingParams
from edge.textstream import TextStream


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
    or "length" (max_tokens or the context full). Token counts as OpenAI's usage."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


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
    alternatives (0..20). emit: called with each event, on the scheduler thread.
    """

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[object], None]
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    cancelled: bool = False
    t_submit: float = 0.0


@dataclass(eq=False)
class _Seq:
    req: Request
    slot: int
    n_cached: int
    sampler: Sampler
    text: TextStream
    history: list[int]
    n_prompt_done: int          # prompt tokens whose K/V are computed
    next_token: int | None = None
    t_last: float = 0.0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    done: bool = False

    @property
    def n_generated(self) -> int:
        """Tokens generated so far (history holds the prompt, then them)."""
        return len(self.history) - len(self.req.prompt_ids)


@dataclass
class SchedulerStats:
    """Counters and gauges for /metrics (cumulative counts since start)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    requests_finished: int = 0


class Scheduler:
    """Serves generation requests on ``engine`` with continuous batching (module docstring).

    Args:
        engine: an Engine whose n_seq is the number of sequences served at once.
        max_queue: most requests waiting for a slot; more get QueueFull.
        n_batch: most rows (prompt tokens plus decode rows) per forward pass.
        threads: numba threads for the forward passes (default: numba's setting).
        observe: called as observe(ttft=seconds) at a request's first token and
            observe(tpot=seconds) between later tokens (metrics).

    submit() and cancel() may be called from any thread; stop() ends the thread.
    """

    def __init__(self, engine, max_queue: int = 64, n_batch: int = 512, threads: int | None = None,
                 observe: Callable[..., None] | None = None):
        self.engine = engine
        self.model = engine.model
        self.model.set_batch_invariant(True)
        self.kv = engine.kv
        self.n_ctx = engine.n_ctx
        self.max_queue = max_queue
        self.n_batch = n_batch
        self.threads = threads
        self._observe = observe or (lambda **kw: None)
        self.stats = SchedulerStats()
        self._waiting: deque[Request] = deque()
        self._running: list[_Seq] = []
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

    def busy(self) -> bool:
        with self._cv:
            return bool(self._waiting or self._running)

    # ---- scheduler thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        if self.threads:                   # numba's thread count is per calling thread
            import numba
            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        while True:
            with self._cv:
                while not (self._waiting or self._running or self._stopping):
                    self._cv.wait()
                if self._stopping and not (self._waiting or self._running):
                    return
            try:
                self._step()
            except Exception as e:   # a bug must not kill the server: fail the batch, go on
                message = f"internal error: {type(e).__name__}: {e}"
                traceback.print_exc()
                for seq in self._running:
                    self._safe_emit(seq.req, Failed(message))
                    self.kv.free(seq.slot)
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
                    slot, n_cached = self.kv.new_sequence(req.prompt_ids)
                except (NoFreeSlot, NoFreeBlocks):
                    return
                self._waiting.popleft()
            seq = _Seq(req, slot, n_cached, Sampler(req.params), TextStream(self.engine.tokenizer, req.stop),
                       list(req.prompt_ids), n_cached)
            self._running.append(seq)
            self.stats.prompt_tokens += len(req.prompt_ids)
            self.stats.cached_tokens += n_cached

    def _step(self) -> None:
        for seq in [s for s in self._running if s.req.cancelled]:
            self._retire(seq)
        self._admit()
        if not self._running:
            return
        tokens, seq_ids, logits_rows, owners = [], [], [], []
        for seq in self._running:                       # decode rows
            if seq.next_token is not None:
                self.kv.append(seq.slot, [seq.next_token])
                if not self._reserve(seq, 1):
                    continue
                tokens.append(seq.next_token)
                seq_ids.append(seq.slot)
                logits_rows.append(len(tokens) - 1)
                owners.append(seq)
                seq.next_token = None
        budget = max(self.n_batch - len(tokens), 1)
        for seq in self._running:                       # prefill chunks, oldest first
            n_prompt = len(seq.req.prompt_ids)
            if seq.n_prompt_done >= n_prompt or budget <= 0:
                continue
            chunk = seq.req.prompt_ids[seq.n_prompt_done : seq.n_prompt_done + budget]
            if not self._reserve(seq, len(chunk)):
                continue
            tokens.extend(chunk)
            seq_ids.extend([seq.slot] * len(chunk))
            seq.n_prompt_done += len(chunk)
            budget -= len(chunk)
            if seq.n_prompt_done == n_prompt:
                logits_rows.append(len(tokens) - 1)
                owners.append(seq)
        if tokens:
            self._forward(tokens, seq_ids, logits_rows, owners)
        for seq in [s for s in self._running if s.req.cancelled or s.done]:
            self._retire(seq)

    def _reserve(self, seq: _Seq, n: int) -> bool:
        """Give disk space to the next n positions of seq's KV (PagedKVCache.reserve). When the
        file system is full, the request fails with a 503 (its blocks are freed when it is
        retired; the others go on) and False is returned: it takes no part in the step."""
        try:
            self.kv.reserve(seq.slot, n)
        except KVNoSpace as e:
            self._safe_emit(seq.req, Failed(str(e), status=503, code="insufficient_storage"))
            seq.done = True
            return False
        return True

    def _forward(self, tokens: list[int], seq_ids: list[int], logits_rows: list[int], owners: list[_Seq]) -> None:
        """One forward pass over the step's rows, then sampling of each owner's next token."""
        logits = self.model.forward(np.asarray(tokens, np.int64), self.kv,
                                    logits_rows=np.asarray(logits_rows, np.int64),
                                    seq_ids=np.asarray(seq_ids, np.int64))
        now = time.perf_counter()
        for row, seq in enumerate(owners):
            if seq.req.cancelled:
                continue
            try:
                self._sample(seq, logits[row], now)
            except Exception as e:   # this request's fault (e.g. its logit_bias): it alone fails
                self._safe_emit(seq.req, Failed(f"{type(e).__name__}: {e}"))
                seq.done = True

    def _sample(self, seq: _Seq, logits: np.ndarray, now: float) -> None:
        req = seq.req
        if req.logprobs is not None:
            tok, lp, top = seq.sampler.sample_with_logprobs(logits, seq.history, req.logprobs)
        else:
            tok, lp, top = seq.sampler.sample(logits, seq.history), None, None
        if seq.n_generated == 0:
            self._observe(ttft=now - req.t_submit)
        else:
            self._observe(tpot=now - seq.t_last)
        seq.t_last = now
        tokenizer = self.engine.tokenizer
        if tokenizer.is_eog(tok):
            self._finish(seq, "stop")
            return
        self.stats.generated_tokens += 1
        seq.history.append(tok)
        if lp is not None:
            seq.pending_logprobs.append(TokenLogprob(tok, lp, top))
        released = seq.text.push(tok)
        self._emit_delta(seq, released)
        if released.stopped:
            self._finish(seq, "stop", flush=False)
        elif req.max_tokens is not None and seq.n_generated >= req.max_tokens:
            self._finish(seq, "length")
        elif self.kv.num_tokens(seq.slot) + 1 > self.n_ctx:
            self._finish(seq, "length")
        else:
            seq.next_token = tok

    def _emit_delta(self, seq: _Seq, released) -> None:
        lps = []
        if seq.req.logprobs is not None and released.tokens:
            n = len(released.tokens)
            lps, seq.pending_logprobs = seq.pending_logprobs[:n], seq.pending_logprobs[n:]
        if released.text or lps:
            self._safe_emit(seq.req, Delta(released.text, lps))

    def _finish(self, seq: _Seq, reason: str, flush: bool = True) -> None:
        if flush:
            self._emit_delta(seq, seq.text.finish())
        self._safe_emit(seq.req, Finished(reason, len(seq.req.prompt_ids), seq.n_generated, seq.n_cached))
        self.stats.requests_finished += 1
        seq.done = True

    def _retire(self, seq: _Seq) -> None:
        self.kv.free(seq.slot)
        self._running.remove(seq)


    @staticmethod
    def _safe_emit(req: Request, event) -> None:
        if req.cancelled:
            return
        try:
            req.emit(event)
        except Exception:   # a gone client's loop: the request is as good as cancelled
            req.cancelled = True
