"""`edge serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) over the scheduler.

Routes: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events or
not), GET /v1/models, POST /tokenize, POST /detokenize (llama-server's shapes), GET /health
(503 while the model loads, then 200), GET /metrics (Prometheus text); Anthropic's Messages API
(edge.server.anthropic) and OpenAI's Responses API (edge.server.responses) translate their
requests into a chat completion (start_chat) and its answer back. A request constrained
by response_format json_object / json_schema, json_schema or grammar (protocol's
``constraint``) gets an edge.grammar.GrammarMask in its sampler's mask stage. ``tools`` are
rendered by the model's chat template and its answer is read for calls (edge.tool_calls);
tool_choice "required" or a named function constrains it with the calls' grammar.

Every error is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for the
client's mistakes (bad JSON, wrong types, out-of-range values, unknown model, a prompt longer
than the context, a chat template's own error, a field not implemented: 400; a foreign Host or
Origin: 403; a body larger than any prompt that fits: 413; not application/json: 415; a request
that does not arrive whole in --timeout: 408) and 503 when the queue is full, the model is not
loaded yet or the KV cache's file system is full (that request fails, its KV blocks are freed,
the others go on); an unexpected exception becomes a 500 of the same shape and the server goes
on (under /v1/messages the error is Anthropic's shape and status: edge.server.anthropic). With an
API key, every route but /health needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``; the Host
and Origin checks and CORS are edge.server.guard's.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from edge import __version__
from edge.chat_template import CHAT_TEMPLATE_KEY, ChatTemplateError, NoChatTemplateError
from edge.engine import ContextLengthExceeded
from edge.grammar import GrammarError, GrammarMask, LazyGrammarMask, ll_tokenizer
from edge.sampling import InvalidParameter, SamplingParams
from edge.server import protocol as P, thinking
from edge.server.metrics import Metrics
from edge.server.pool import DEFAULT_KEEP_ALIVE, ModelPool, ModelSlot
from edge.server.scheduler import STEP_LOCK, Delta, Failed, Finished, QueueFull, Scheduler
from edge.server.scheduler import Request as GenRequest
from edge.tool_calls import ToolCallParser, call_grammar, lazy_call_grammar, template_renders_tools
from edge.tool_calls import detect_format as tool_format

MAX_TOP_LOGPROBS = 20
SYSTEM_FINGERPRINT = f"edge-{__version__}"    # OpenAI's system_fingerprint: the build that answered
MAX_N = 16                                      # most choices a request may ask for (n)
ROOT_TEXT = "edge is running (Ollama is running: its API is served under /api)"
CLIENT_GONE = 499      # nginx's "client closed request": the status of a response nobody reads


@dataclass
class ServerConfig:
    """What `edge serve` was started with (see edge.cli)."""

    model: str | None = None
    n_ctx: int = 4096
    n_parallel: int = 4
    max_queue: int = 64
    n_batch: int = 512
    threads: int | None = None
    api_key: str | None = None
    host: str = "127.0.0.1"                 # the address listened on (a Host it is always allowed)
    allowed_hosts: tuple[str, ...] = ()     # more Host names to answer ("*" = any)
    cors_origins: tuple[str, ...] = ()      # web page origins allowed besides loopback ("*" = any)
    kv_storage: str = "file"
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    spec: object = None                     # edge.speculative.SpecParams (None: no speculation)
    model_draft: str | None = None          # the draft model for spec_type "draft"
    on_load_error: Callable[[str], None] | None = None   # called (on the load thread) with the error
    on_event: Callable[[str], None] | None = None   # told "loaded NAME in S s", "unloaded NAME" (any thread)
    reasoning_budget: int = -1              # reasoning tokens before </think> is forced (-1: no limit)
    router: bool = False                    # serve every pulled model by name (no -m given)
    models_max: int = 3                     # models held at once (router)
    models_memory: int | None = None        # bytes of models held at once (None: 3/4 of memory)
    keep_alive: float | None = DEFAULT_KEEP_ALIVE   # idle seconds before a model unloads (None: never)
    load_timeout: float = 300.0             # seconds a request waits for its model to load
    log_requests: bool = True               # one line on stderr per request (RequestLog)
    alias: str | None = None                # the -m model's name in responses (--alias)
    pooling: str | None = None              # embeddings' pooling (None: the model's; edge.server.embeddings)
    slot_save_path: str | None = None       # llama-server's /slots save / restore folder (None: 501)


def _warm_up(scheduler: Scheduler) -> None:
    """Compile (or load) every path's kernels before /health says ready, so the first request
    waits for no compile (GenerationLoop.warm_up). Called while nothing can be submitted."""
    scheduler.loop.warm_up()


class ServerState:
    """The server's models (edge.server.pool.ModelPool) and metrics. The default model loads
    with load() on a thread at start; ``engine`` / ``scheduler`` / ``load_error`` are the
    default model's."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.pool = ModelPool(self._load_model, router=config.router, models_max=config.models_max,
                              memory_budget=config.models_memory, keep_alive=config.keep_alive,
                              load_timeout=config.load_timeout, on_event=config.on_event)
        self.load_error: str | None = None
        self.started = False              # the default model loaded once (a router server is up)
        self._stored: tuple | None = None          # (store key, list_models()) for /v1/models
        self.metrics = Metrics(self)
        self.created = int(time.time())

    @property
    def engine(self):
        slot = self.pool.default
        return slot.engine if slot is not None else None

    @property
    def scheduler(self) -> Scheduler | None:
        slot = self.pool.default
        return slot.scheduler if slot is not None else None

    def load(self) -> None:
        """Load the default model (config.model) on this thread; an error is kept for /health
        and every request, and handed to config.on_load_error."""
        from edge.store import resolve_model
        try:
            slot = self.pool.start_default(resolve_model(self.config.model), self.config.model, self.config.alias)
        except Exception as e:
            self._failed(e)
            return
        self.pool._load(slot)
        self.started = slot.status == "loaded"     # /health: ok from now on, whatever loads later
        if slot.status != "loaded":
            self.load_error = slot.error
            if self.config.on_load_error is not None:
                self.config.on_load_error(slot.error.split(": ", 1)[-1])

    def _failed(self, e: Exception) -> None:
        self.load_error = f"{type(e).__name__}: {e}"
        if self.config.on_load_error is not None:
            self.config.on_load_error(str(e))

    def _load_model(self, slot: ModelSlot) -> None:
        """Build ``slot``'s engine and scheduler and compile (or load) their kernels."""
        from edge.engine import Engine
        from edge.store import resolve_model

        c = self.config
        engine = Engine(slot.path, n_ctx=c.n_ctx, n_batch=c.n_batch, n_seq=c.n_parallel,
                        cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v, kv_storage=c.kv_storage)
        if c.spec is not None and c.spec.enabled:
            draft = None
            if c.model_draft and slot is self.pool.default:
                draft = Engine(resolve_model(c.model_draft), n_ctx=c.n_ctx, n_batch=c.n_batch,
                               n_seq=c.n_parallel, cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v,
                               kv_storage=c.kv_storage, batch_invariant=True)
            if draft is not None or c.spec.spec_type != "draft":
                engine.set_speculative(c.spec, draft)
        name = slot.name
        scheduler = Scheduler(engine, max_queue=c.max_queue, n_batch=c.n_batch, threads=c.threads,
                              observe=lambda **kw: self.metrics.observe(name, **kw))
        try:
            with STEP_LOCK:
                _warm_up(scheduler)
            ll_tokenizer(engine.tokenizer)     # built once (about 1 s): no constrained request waits for it
            slot.engine, slot.scheduler = engine, scheduler
            slot.max_piece_bytes()
            self.metrics.add_model(name)
            kv = getattr(engine, "kv", None)
            slot.bytes = slot.path.stat().st_size + int(getattr(kv, "nbytes", 0) or 0)
        except BaseException:
            scheduler.stop()
            raise

    def model_id(self) -> str:
        """The default model's id in responses and /v1/models: the GGUF file's stem, the name
        `edge list` and `-m` use (e.g. qwen2.5-coder-0.5b-instruct)."""
        slot = self.pool.default
        return slot.name if slot is not None else ""

    def max_piece_bytes(self) -> int:
        slot = self.pool.default
        return slot.max_piece_bytes() if slot is not None and slot.engine is not None else 256

    def stored_models(self) -> list[dict]:
        """edge.store.list_models(), read again only when a store file changed (name, size or
        modification time): it parses every GGUF header."""
        from edge.store import list_models, models_dir

        folder = models_dir()
        if not folder.is_dir():
            return []
        try:
            key = tuple(sorted((p.name, st.st_size, st.st_mtime_ns) for p in folder.glob("*.gguf")
                               for st in [p.stat()]))
        except OSError:
            key = None
        if key is None or self._stored is None or self._stored[0] != key:
            self._stored = (key, list_models())
        return self._stored[1]

    def loaded(self) -> list[dict]:
        """The models in memory: {"name", "engine", "expires_at" (epoch seconds or None: kept),
        "slot"}."""
        return [{"name": s.name, "engine": s.engine, "expires_at": s.expires_at(), "slot": s}
                for s in self.pool.loaded()]

    def _check_loading(self) -> None:
        if self.load_error:
            raise P.APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
        if self.pool.default is None and not self.pool.router:
            raise P.APIError(503, "the model is loading; retry shortly", code="loading")
        slot = self.pool.default
        if slot is not None and not slot.ready.is_set() and not self.pool.router:   # router: acquire waits
            raise P.APIError(503, "the model is loading; retry shortly", code="loading",
                             headers={"Retry-After": "1"})

    def require(self, model: str | None = None):
        """(engine, scheduler) of a loaded model a request names (None: the default). Raises
        APIError: 404 model_not_found for a name this server does not serve or hold, 503 while
        the default model loads or when it failed to load."""
        self._check_loading()
        slot = self.pool.find(model)
        if slot is None and model is None and self.pool.router:     # the default was unloaded: load it again
            slot = self.pool._slot_to_load(self.pool.default_path, None)
        if slot is None or slot.status != "loaded":
            if slot is not None:
                raise P.APIError(503, f"the model {slot.name!r} is loading; retry shortly", code="loading",
                                 headers={"Retry-After": "1"})
            raise self.pool._not_found(model)
        return slot.engine, slot.scheduler

    async def acquire(self, model: str | None, keep_alive="default", any_name: bool = True,
                      check=None) -> ModelSlot:
        """The loaded slot of ``model`` with a lease (ModelPool.acquire): load it if needed;
        with ``any_name`` (the OpenAI and Anthropic routes) a server started with -m serves
        any name. Give it back with ``self.pool.release(slot)`` once the request is submitted."""
        self._check_loading()
        return await self.pool.acquire(model, keep_alive, any_name, check)


# bytes a body may have whatever n_ctx: for generation (text that cannot fit is refused before it
# is tokenized), for /tokenize and /detokenize (done whatever the length, at a few MB/s at best)
MIN_BODY_LIMIT = 8 << 20
MIN_TOKENIZE_BODY_LIMIT = 2 << 20


async def _body(request: Request, state: "ServerState", model_cls, min_limit: int = MIN_BODY_LIMIT):
    """The request's JSON body validated as ``model_cls``. Raises APIError: 415 unless it is
    sent as application/json, 413 past max(min_limit, 8 x n_ctx x the longest token's bytes),
    more than any prompt that fits can need, 400 for bad JSON (protocol.parse_json_object) or
    fields."""
    P.check_content_type(request.headers.get("content-type"))
    limit = max(min_limit, 8 * state.config.n_ctx * state.max_piece_bytes())
    chunks, n = [], 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise P.APIError(413, f"the request body is larger than {limit} bytes, more than any prompt that "
                                      f"fits the context (n_ctx {state.config.n_ctx}) can need",
                                 code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise P.APIError(CLIENT_GONE, "the client went away", code="client_gone") from None
    return await run_in_threadpool(_validate, b"".join(chunks), model_cls)   # megabytes: off the event loop


def _validate(raw: bytes, model_cls):
    try:
        return model_cls.model_validate(P.parse_json_object(raw))
    except ValidationError as e:
        raise P.validation_error(e) from None


def no_chat_template(name: str) -> P.APIError:
    return P.APIError(400, f"model {name!r} has no chat template, so it cannot take chat messages; send the "
                           "text to POST /v1/completions instead", param="messages", code="no_chat_template")


def has_chat_template(path, name: str) -> None:
    """Raise no_chat_template (400) when the GGUF at ``path`` has no tokenizer.chat_template:
    read from its header, before the model is loaded. An unreadable file is left to the load."""
    from edge.gguf_file import GGUFError, GGUFFile

    try:
        gf = GGUFFile(path)
    except (GGUFError, OSError):
        return
    try:
        source = gf.get(CHAT_TEMPLATE_KEY)
    finally:
        gf.close()
    if source is None or (isinstance(source, str) and not source.strip()):
        raise no_chat_template(name)


def _sampling(body, engine) -> SamplingParams:
    kw = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
                 "presence_penalty", "frequency_penalty", "seed"):
        value = getattr(body, name)
        if value is not None:
            kw[name] = value
    if kw.get("seed") is not None and kw["seed"] < 0:
        kw["seed"] = None                          # llama-server: -1 = random
    bias = {}
    if body.logit_bias:
        for key, value in body.logit_bias.items():
            try:
                tok = int(key)
            except ValueError:
                raise P.APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias",
                                 code="invalid_value") from None
            if not 0 <= tok < engine.model.args.n_vocab:
                raise P.APIError(400, f"logit_bias token {tok} is not in the vocabulary (0..{engine.model.args.n_vocab - 1})",
                                 param="logit_bias", code="invalid_value")
            bias[tok] = value
    if body.ignore_eos:                            # llama-server: every end-of-generation token banned
        bias.update(dict.fromkeys(engine.tokenizer.eog_ids, -math.inf))
    if bias:
        kw["logit_bias"] = bias
    if body.samplers is not None:
        kw |= sampler_fields(body.samplers, body.temperature)
        if "infill" in _sampler_names(body.samplers):
            kw["infill"] = True
    try:
        params = SamplingParams(**kw)
    except InvalidParameter as e:
        raise P.APIError(400, str(e), param=e.param, code="invalid_value") from None
    if body.samplers is not None:
        _check_samplers(body.samplers, params, engine.model.args.n_vocab)
    return params


# llama.cpp's default sampler order, by name and by letter (common_sampler_type), and infill
_SAMPLER_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_SAMPLER_LETTERS = {**dict(zip("edskypmxt", _SAMPLER_ORDER)), "i": "infill"}


# llama.cpp's other spellings of the names (common_sampler_types_from_names: kebab-case, no
# underscore, and three more), matched without case
_SAMPLER_ALIASES = {**{n.replace("_", sep): n for n in (*_SAMPLER_ORDER, "infill") if "_" in n for sep in ("-", "")},
                    "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}


def _sampler_names(samplers) -> list:
    """llama-server's ``samplers`` (names in any of llama.cpp's spellings, or letters as one
    string) as canonical names; a name llama.cpp does not know is left out (it warns and goes
    on)."""
    if isinstance(samplers, str):
        names = [_SAMPLER_LETTERS.get(c) for c in samplers]
    else:
        names = [n.lower() if isinstance(n, str) else None for n in samplers]
        names = [_SAMPLER_ALIASES.get(n, n) for n in names]
    return [n for n in names if n in _SAMPLER_ORDER or n == "infill"]


def sampler_fields(samplers, temperature) -> dict:
    """The sampling fields llama-server's ``samplers`` list implies: the list is the chain, so
    a sampler left out is off (top_k 0, top_p 1, min_p 0, penalties neutral, temperature 1
    unless the request asks 0 or less: greedy stays greedy). Same on every route."""
    names = _sampler_names(samplers)
    off = {}
    if "top_k" not in names:
        off["top_k"] = 0
    if "top_p" not in names:
        off["top_p"] = 1.0
    if "min_p" not in names:
        off["min_p"] = 0.0
    if "penalties" not in names:
        off |= {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    if "temperature" not in names and not (temperature is not None and temperature <= 0):
        off["temperature"] = 1.0
    return off


def _speculative(body) -> dict:
    """A request's speculative.n_max / n_min / p_min (llama-server's fields), as given."""
    given = {"n_max": body.speculative_n_max, "n_min": body.speculative_n_min, "p_min": body.speculative_p_min}
    return {k: v for k, v in given.items() if v is not None}


def _check_samplers(samplers, params: SamplingParams, n_vocab: int) -> None:
    """Raise APIError (400) unless ``samplers`` (names, or letters as one string) keeps
    llama.cpp's default order and names every sampler this request turns on: the one chain
    this server runs (sampler_fields turned the ones left out off). "infill" (SamplingParams.infill)
    may stand anywhere after the samplers that are on: edge runs it after them all, just before
    the draw, which is where llama.cpp runs it then (a sampler that is off does nothing)."""
    names = _sampler_names(samplers)
    on = {"penalties": params.repeat_last_n != 0 and (params.repeat_penalty != 1 or params.presence_penalty != 0
                                                       or params.frequency_penalty != 0),
          "top_k": 0 < params.top_k < n_vocab, "top_p": params.top_p < 1, "min_p": params.min_p > 0,
          "temperature": params.temperature > 0 and params.temperature != 1}
    positions = [_SAMPLER_ORDER.index(n) for n in names if n != "infill"]
    missing = [n for n, active in on.items() if active and n not in names]
    if positions != sorted(positions) or missing:
        why = f"{missing[0]} is on but not listed" if missing else "the order differs"
        raise P.APIError(400, f"samplers: only llama.cpp's default order ({';'.join(_SAMPLER_ORDER)}) is supported, "
                              f"with every sampler that is on listed ({why})", param="samplers",
                         code="unsupported_value")
    after = [n for n in names[names.index("infill") + 1:] if on.get(n)] if "infill" in names else []
    if after:
        raise P.APIError(400, f"samplers: infill is supported after every sampler that is on ({after[0]} is on and "
                              "comes after it)", param="samplers", code="unsupported_value")


def _check_common(body, state: ServerState, max_tokens, max_tokens_param: str = "max_tokens") -> None:
    body.check_not_implemented()
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise P.APIError(400, f"n must be in 1..{MAX_N}, got {body.n}", param="n", code="invalid_value")
    if max_tokens is not None and max_tokens < 1:
        raise P.APIError(400, f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param,
                         code="invalid_value")


def _too_long_to_tokenize(slot: ModelSlot, n_bytes: int, param: str) -> None:
    """400 at once for text that cannot fit n_ctx whatever its tokens: no token is longer than
    the vocabulary's longest piece, so it has at least n_bytes / that many tokens (spares
    the server from tokenizing megabytes only to refuse them)."""
    n_ctx = slot.engine.n_ctx
    at_least = -(-n_bytes // slot.max_piece_bytes())
    if at_least > n_ctx:
        raise P.APIError(400, f"the prompt has at least {at_least} tokens but the context size (n_ctx) is "
                              f"{n_ctx}; shorten the prompt or raise -c/--ctx-size", param=param,
                         code="context_length_exceeded", extra={"n_prompt_tokens": at_least, "n_ctx": n_ctx})


def _processors(grammar, param: str | None, engine, n_prompt: int) -> list:
    """The mask stage of a request constrained by ``grammar`` (edge.grammar.GrammarMask; none
    without one). Compiles the grammar (and, the first time, the vocabulary's llguidance
    tokenizer): run it off the event loop. Raises APIError (400, param: the field) when
    llguidance refuses the grammar."""
    if grammar is None:
        return []
    try:
        return [GrammarMask(grammar, engine.tokenizer, n_prompt)]
    except GrammarError as e:
        raise P.APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None


def _tool_grammar(allowed: list[dict], fmt: str, parallel: bool, other: str | None):
    """The grammar of tool_choice "required" / a named function (edge.tool_calls.call_grammar).
    Raises APIError (400) beside another constraint, or for a parameters schema llguidance refuses."""
    if other is not None:
        raise P.APIError(400, f"tool_choice: a required tool call and {other} both constrain the answer: give one",
                         param="tool_choice", code="invalid_value")
    try:
        return call_grammar(allowed, fmt, parallel), "tools"
    except GrammarError as e:
        raise P.APIError(400, f"tools: a function's parameters: {e}", param="tools", code="invalid_value") from None


def _lazy_tool_mask(allowed: list[dict], fmt: str, parallel: bool, engine, n_prompt: int) -> list:
    """tool_choice "auto": the mask stage that holds a call, once its tag opens, to the tools'
    names and parameter schemas (edge.tool_calls.lazy_call_grammar; none for formats without
    a tag). Raises APIError (400) for a parameters schema llguidance refuses."""
    try:
        lazy = lazy_call_grammar(allowed, fmt, parallel)
        return [] if lazy is None else [LazyGrammarMask(*lazy, engine.tokenizer, n_prompt)]
    except GrammarError as e:
        raise P.APIError(400, f"tools: a function's parameters: {e}", param="tools", code="invalid_value") from None


def _tool_message(parser: ToolCallParser, message: dict, finish: str) -> tuple[dict, str]:
    """(the chat message, finish_reason) with its content read for tool calls: content outside
    the calls (None when there is none), tool_calls, finish_reason "tool_calls" when it has some
    (a cut by max_tokens stays "length", as OpenAI reports it)."""
    events = parser.feed(message["content"] or "") + parser.finish()
    message = {**message, "content": "".join(v for k, v in events if k == "content") or None}
    if parser.calls:
        message["tool_calls"] = [c.openai() for c in parser.calls]
        finish = "length" if finish == "length" else "tool_calls"
    return message, finish


def _tool_deltas(parser: ToolCallParser, parts: list[dict], final: bool) -> list[dict]:
    """The streamed ``delta`` objects ``parts`` with their content read for tool calls (``final``:
    the answer ended): content deltas, and per call OpenAI's tool_calls deltas (``index`` on
    each; id, type and name in the first, the arguments after). Other deltas pass as they are."""
    events = []
    for part in parts:
        if "content" in part:
            rest = {k: v for k, v in part.items() if k != "content"}
            if rest:
                events.append(("delta", rest))
            events += parser.feed(part["content"])
        else:
            events.append(("delta", part))
    if final:
        events += parser.finish()
    out = []
    for kind, value in events:
        if kind == "delta":
            out.append(value)
        elif kind == "content":
            out.append({"content": value})
        else:
            i = parser.calls.index(value)
            out.append({"tool_calls": [{"index": i, "id": value.id, "type": "function",
                                        "function": {"name": value.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": value.arguments}}]})
    return out


def _model_entry(slot: ModelSlot | None, state: ServerState, info: dict | None = None) -> dict:
    """A /v1/models entry: OpenAI's id / object / created / owned_by, the model's status
    (loaded, loading, unloaded), its context size (``context_length`` and ``meta.n_ctx``: what a
    request may use) and, as llama-server's ``meta``, the vocabulary and architecture."""
    status = "unloaded" if slot is None else slot.status if slot.status in ("loaded", "loading") else "unloaded"
    engine = slot.engine if slot is not None and slot.status == "loaded" else None
    name = slot.name if slot is not None else info["name"]
    n_ctx = engine.n_ctx if engine is not None else state.config.n_ctx
    meta = {"n_ctx": n_ctx}
    if engine is not None:
        meta |= {"n_vocab": engine.model.args.n_vocab, "architecture": engine.model.args.arch}
    elif info is not None:
        meta |= {"architecture": info["architecture"], "n_params": info["n_params"]}
    size = slot.path.stat().st_size if slot is not None and slot.path.exists() else info["size"] if info else None
    meta["size"] = size
    out = {"id": name, "object": "model", "created": state.created, "owned_by": "edge", "status": status,
           "context_length": n_ctx, "meta": meta}
    if slot is not None and status == "loaded":
        out["expires_at"] = slot.expires_at()
    return out


def _piece(engine, tok: int) -> tuple[str, list[int]]:
    raw = engine.tokenizer.token_to_piece(tok)
    return raw.decode("utf-8", errors="replace"), list(raw)


class _Stream:
    """A submitted request's events, received on the event loop."""

    def __init__(self, scheduler: Scheduler, gen: GenRequest):
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        gen.emit = lambda ev: loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        self.scheduler, self.gen = scheduler, gen
        self.finished = False

    def submit(self) -> None:
        try:
            self.scheduler.submit(self.gen)
        except ContextLengthExceeded as e:
            raise P.APIError(400, str(e), param="messages", code="context_length_exceeded",
                             extra={"n_prompt_tokens": e.n_prompt, "n_ctx": e.n_ctx}) from None
        except QueueFull as e:
            raise P.APIError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from None
        except RuntimeError as e:
            raise P.APIError(503, str(e), code="shutting_down") from None

    async def events(self):
        """The request's Delta events, then its Finished; ends early, without Finished, once
        cancel() was called. Raises APIError for Failed (its status and code)."""
        while True:
            ev = await self.queue.get()
            if ev is None:                  # cancel(): the scheduler emits nothing more
                self.finished = True
                return
            if isinstance(ev, Failed):
                self.finished = True
                raise P.APIError(ev.status, ev.message, code=ev.code)
            yield ev
            if isinstance(ev, Finished):
                self.finished = True
                return

    def cancel(self) -> None:
        """Stop the generation (its client went away) and end events(). Event loop only."""
        if not self.finished:
            self.scheduler.cancel(self.gen)
            self.queue.put_nowait(None)


async def _watch_disconnect(request: Request, stream: _Stream) -> None:
    """For a non-streamed request: cancel its generation when the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.cancel()
            return


async def _collect(request: Request, stream: _Stream) -> tuple[list[Delta], Finished | None]:
    """A non-streamed request's events: (deltas, Finished), or (deltas, None) when the client
    went away first (its generation is then cancelled)."""
    watcher = asyncio.create_task(_watch_disconnect(request, stream))
    deltas, fin = [], None
    try:
        async for ev in stream.events():
            if isinstance(ev, Delta):
                deltas.append(ev)
            else:
                fin = ev
    finally:
        watcher.cancel()
        stream.cancel()
    return deltas, fin


def _usage(fin: Finished) -> dict:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _sse_response(chunks, head: dict, include_usage: bool, run) -> StreamingResponse:
    """OpenAI's streamed response: each chunk dict of ``chunks`` (an async iterator, e.g.
    ChatRun.chunks()) as a server-sent event, with ``"usage": null`` when include_usage, then
    with include_usage one chunk of ``head`` fields with empty choices and ``run``'s usage, then
    [DONE]. An error mid-stream becomes an error event; the generation is cancelled when the
    stream ends early (the client went away)."""
    async def events():
        try:
            async for c in chunks:
                yield _sse({**c, "usage": None} if include_usage else c)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": run.usage(), "timings": run.timings()})
            yield "data: [DONE]\n\n"
        except P.APIError as e:
            yield _sse(e.body())
        finally:
            run.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Run:
    """A submitted generation: its events turned into OpenAI's shapes. ``complete()`` gives the
    whole response (a dict), ``chunks()`` its streamed chunks (dicts) one Delta at a time; use
    one of them, once. ``usage()`` is valid after either has finished. Adapters of other APIs
    (Ollama's, Anthropic's, the Responses API) translate these dicts."""

    kind = ""

    def __init__(self, request: Request, stream: _Stream, engine, model: str):
        self.request, self.stream, self.engine, self.model = request, stream, engine, model
        self.created = int(time.time())
        self.fin: Finished | None = None
        self.id = f"{self.kind}-{uuid.uuid4().hex}"

    def usage(self) -> dict:
        return _usage(self.fin)

    def prompt_tokens(self) -> int:
        """The prompt's length in tokens (known before the run ends; usage() has the cached part)."""
        return len(self.stream.gen.prompt_ids)

    def timing(self) -> Finished | None:
        """The Finished event (token counts, finish reason) once the run has ended."""
        return self.fin

    def timings(self) -> dict:
        """llama-server's ``timings`` object (llama_server.timings), valid as usage()."""
        return self.fin.timings()

    def cancel(self) -> None:
        self.stream.cancel()

    async def _collect(self) -> list[Delta] | None:
        deltas, self.fin = await _collect(self.request, self.stream)
        return deltas if self.fin is not None else None


class ChatRun(_Run):
    """A chat completion in flight (see _Run): reasoning split out (edge.server.thinking),
    content read for tool calls when tools were given."""

    kind = "chatcmpl"

    def __init__(self, request, stream, engine, model, reasoning, parser, logprobs):
        super().__init__(request, stream, engine, model)
        self.reasoning, self.parser, self.logprobs = reasoning, parser, logprobs
        self.head = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": model,
                     "system_fingerprint": SYSTEM_FINGERPRINT}

    def _lp_content(self, lps):
        out = []
        for lp in lps:
            text, raw = _piece(self.engine, lp.token)
            top = []
            for t, v in lp.top:
                tt, tb = _piece(self.engine, t)
                top.append({"token": tt, "logprob": v, "bytes": tb})
            out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return out

    async def complete(self) -> dict | None:
        """The chat.completion object, or None when the client went away first."""
        deltas = await self._collect()
        if deltas is None:
            return None
        content = self._lp_content([lp for d in deltas for lp in d.logprobs])
        message, finish = self.reasoning.message("".join(d.text for d in deltas)), self.fin.finish_reason
        if self.parser is not None:
            message, finish = _tool_message(self.parser, message, finish)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": [{"index": 0, "message": message,
                             "logprobs": {"content": content} if self.logprobs is not None else None,
                             "finish_reason": finish}],
                "usage": self.usage(), "timings": self.timings()}

    def _chunk(self, delta, finish=None, lps=None) -> dict:
        return {**self.head, "choices": [{"index": 0, "delta": delta,
                                          "logprobs": {"content": self._lp_content(lps)} if lps else None,
                                          "finish_reason": finish}]}

    def _chunks_of(self, ev, finish=None) -> list[dict]:
        """The chunks of a Delta (or, with ``finish``, of the end): reasoning deltas, then
        content (read for tool calls when tools are given); the logprobs ride on the last
        (an empty delta when the text is held)."""
        lps = ev.logprobs if finish is None else None
        parts = self.reasoning.deltas(ev.text if finish is None else "", final=finish is not None)
        if self.parser is not None:
            parts = _tool_deltas(self.parser, parts, final=finish is not None)
            finish = "tool_calls" if finish not in (None, "length") and self.parser.calls else finish
        if lps and not parts:
            parts = [self.reasoning.empty_delta()]
        out = [self._chunk(d, lps=lps if i == len(parts) - 1 else None) for i, d in enumerate(parts)]
        return out + ([self._chunk({}, finish=finish)] if finish is not None else [])

    async def chunks(self):
        """The chat.completion.chunk objects: the role first, then per Delta its deltas, the
        last with finish_reason. Raises APIError for a failure mid-generation."""
        try:
            # with tools the answer may be only calls: content null, as OpenAI's (a client's
            # accumulated message then has content None, not "")
            yield self._chunk({"role": "assistant", "content": "" if self.parser is None else None})
            async for ev in self.stream.events():
                if isinstance(ev, Finished):
                    self.fin = ev
                for c in self._chunks_of(ev, finish=ev.finish_reason if isinstance(ev, Finished) else None):
                    yield {**c, "timings": self.timings()} if c["choices"][0]["finish_reason"] else c
        finally:
            self.stream.cancel()


class CompletionRun(_Run):
    """A text completion in flight (see _Run)."""

    kind = "cmpl"

    def __init__(self, request, stream, engine, model, logprobs):
        super().__init__(request, stream, engine, model)
        self.logprobs = logprobs
        self.head = {"id": self.id, "object": "text_completion", "created": self.created, "model": model,
                     "system_fingerprint": SYSTEM_FINGERPRINT}

    def _lp_block(self, lps, text_start):
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = text_start
        for lp in lps:
            text, _ = _piece(self.engine, lp.token)
            tokens.append(text)
            token_lps.append(lp.logprob)
            tops.append({_piece(self.engine, t)[0]: v for t, v in lp.top})
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def complete(self) -> dict | None:
        """The text_completion object, or None when the client went away first."""
        deltas = await self._collect()
        if deltas is None:
            return None
        lps = [lp for d in deltas for lp in d.logprobs]
        return {**self.head, "choices": [{"index": 0, "text": "".join(d.text for d in deltas),
                                          "logprobs": self._lp_block(lps, 0) if self.logprobs is not None else None,
                                          "finish_reason": self.fin.finish_reason}],
                "usage": self.usage(), "timings": self.timings()}

    async def chunks(self):
        """The streamed text_completion objects, one per Delta, then one with finish_reason."""
        offset = 0
        try:
            async for ev in self.stream.events():
                text = ev.text if isinstance(ev, Delta) else ""
                lps = ev.logprobs if isinstance(ev, Delta) else None
                lp = self._lp_block(lps, offset) if lps is not None and self.logprobs is not None else None
                finish = ev.finish_reason if isinstance(ev, Finished) else None
                offset += len(text)
                if isinstance(ev, Finished):
                    self.fin = ev
                yield {**self.head, "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
                       **({"timings": self.timings()} if finish else {})}
        finally:
            self.stream.cancel()


class _Runs:
    """The n choices of one request (OpenAI's ``n``): n runs of the same prompt (the prefix
    cache computes it once), merged as choices 0..n-1 under the first run's id; usage counts
    the prompt once and every choice's tokens."""

    def __init__(self, runs: list[_Run]):
        self.runs = runs
        self.head = runs[0].head

    def usage(self) -> dict:
        usages = [r.usage() for r in self.runs]
        out = dict(usages[0])
        out["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out

    @property
    def fin(self):
        return self.runs[0].fin if all(r.fin is not None for r in self.runs) else None

    def cancel(self) -> None:
        for r in self.runs:
            r.cancel()

    async def complete(self) -> dict | None:
        outs = await asyncio.gather(*(r.complete() for r in self.runs))
        if any(o is None for o in outs):
            self.cancel()
            return None
        choices = []
        for i, out in enumerate(outs):
            choices.append({**out["choices"][0], "index": i})
        return {**outs[0], "choices": choices, "usage": self.usage()}

    async def chunks(self):
        """Every run's chunks as they come, each with its choice's index and the first run's id."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i, run):
            try:
                async for c in run.chunks():
                    await queue.put({**c, "id": self.head["id"],
                                     "choices": [{**ch, "index": i} for ch in c["choices"]]})
            except BaseException as e:
                await queue.put(e)
            finally:
                await queue.put(done)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.runs)]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is done:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            self.cancel()


async def _start_n(start, request: Request, body):
    """``start(request, body)`` once, or n times for n choices (seeds seed, seed+1, ... when one
    is given, so that sampled choices differ reproducibly)."""
    n = body.n or 1
    if n == 1:
        return await start(request, body)
    runs = []
    try:
        for i in range(n):
            b = body.model_copy()
            if body.seed is not None and body.seed >= 0:
                b.seed = body.seed + i
            runs.append(await start(request, b))
    except BaseException:
        for r in runs:
            r.cancel()
        raise
    return _Runs(runs)


async def _respond(run: _Run, stream: bool, include_usage: bool):
    """OpenAI's response to ``run``: one JSON object, or with ``stream`` its server-sent events."""
    if not stream:
        out = await run.complete()
        return Response(status_code=CLIENT_GONE) if out is None else JSONResponse(out)
    return _sse_response(run.chunks(), run.head, include_usage, run)


class _Handlers:
    def __init__(self, state: ServerState):
        self.state = state

    # ---- chat -----------------------------------------------------------------------------------

    async def chat(self, request: Request):
        body = await _body(request, self.state, P.ChatCompletionRequest)
        body.check_tool_messages()
        run = await _start_n(self.start_chat, request, body)
        return await _respond(run, body.stream, bool(body.stream_options and body.stream_options.include_usage))

    async def _on_model(self, request: Request, body, start, check=None):
        """``start(request, body, slot)`` on the model ``body`` names, held by a lease until the
        generation is submitted; the model and the run are left in request.state for the log.
        ``check(path, name)``: ModelPool.acquire's check of a model file before its load."""
        request.state.edge_asked = body.model
        slot = await self.state.acquire(body.model, body.keep_alive_seconds(), check=check)
        request.state.edge_model = slot.name
        try:
            request.state.edge_run = run = await start(request, body, slot)
            return run
        finally:
            self.state.pool.release(slot)

    async def start_chat(self, request: Request, body: P.ChatCompletionRequest) -> ChatRun:
        """Check ``body`` and submit its generation on the model it names (loaded first if
        needed: ServerState.acquire). Raises APIError (4xx, 503) as the chat route answers them."""
        return await self._on_model(request, body, self._start_chat, has_chat_template)

    async def _start_chat(self, request: Request, body: P.ChatCompletionRequest, slot: ModelSlot) -> ChatRun:
        state = self.state
        engine, scheduler = slot.engine, slot.scheduler
        body.check_unsupported()
        grammar, grammar_param = body.constraint()
        tool_mode, tools, allowed = body.tool_setup()
        if tools and engine.template is not None and not template_renders_tools(engine.template):
            raise P.APIError(400, f"tools: model {slot.name!r} does not support tools (its chat template does not "
                                  "render them); leave tools out or send tool_choice: \"none\"", param="tools",
                             code="unsupported_value")
        if body.max_completion_tokens is not None:     # OpenAI's newer name wins
            max_tokens, max_tokens_param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_tokens_param = body.max_tokens_given()
        _check_common(body, state, max_tokens, max_tokens_param)
        if body.n_probs and not body.logprobs:         # llama-server's name for top_logprobs
            body.logprobs, body.top_logprobs = True, body.n_probs
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise P.APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
            if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
                raise P.APIError(400, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {body.top_logprobs}",
                                 param="top_logprobs", code="invalid_value")
        params = _sampling(body, engine)
        for i, m in enumerate(body.messages):
            if m.content is None and m.role != "assistant":
                raise P.APIError(400, f"messages[{i}].content is null: a {m.role} message needs content",
                                 param=f"messages.{i}.content", code="invalid_value")
        ids = await self.chat_prompt(slot, body, tools)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        fmt = tool_format(engine.template.source if engine.template is not None else None)
        if tool_mode == "required":
            grammar, grammar_param = _tool_grammar(allowed, fmt, body.parallel_tool_calls, grammar_param)
        parser = ToolCallParser(fmt, body.parallel_tool_calls, [t["function"]["name"] for t in allowed],
                                forced=tool_mode == "required") if tool_mode != "none" else None
        processors = await run_in_threadpool(_processors, grammar, grammar_param, engine, len(ids))
        if tool_mode == "auto" and not processors:
            processors = await run_in_threadpool(_lazy_tool_mask, allowed, fmt, body.parallel_tool_calls, engine,
                                                 len(ids))
        reasoning = thinking.ChatReasoning(engine, ids, state.config.reasoning_budget, constrained=bool(processors))
        gen = GenRequest(ids, params, emit=None, max_tokens=max_tokens, stop=body.stop_list(), logprobs=logprobs,
                         processors=processors + reasoning.processors, speculative=_speculative(body))
        stream = _Stream(scheduler, gen)
        stream.submit()
        return ChatRun(request, stream, engine, slot.name, reasoning, parser, logprobs)

    async def chat_prompt(self, slot: ModelSlot, body: P.ChatCompletionRequest, tools: list[dict]) -> list[int]:
        """The prompt tokens of a chat request: its messages and ``tools`` (body.tool_setup()'s)
        rendered by the model's chat template with the generation prompt (what start_chat
        generates from; Anthropic's count_tokens counts them). Raises APIError (400): no chat
        template, the template's own error, text that cannot fit n_ctx."""
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text(),
                     **m.template_fields()} for m in body.messages]
        engine = slot.engine
        _too_long_to_tokenize(slot, sum(len(m["content"].encode()) for m in messages), "messages")
        variables = thinking.template_variables(body, engine.tokenizer, self.state.config.reasoning_budget)
        tools_variable = {"tools": tools} if tools else {}
        try:
            return await run_in_threadpool(engine.chat_prompt, messages, True, {**variables, **tools_variable})
        except NoChatTemplateError:       # C3
            raise no_chat_template(slot.name) from None
        except ChatTemplateError as e:   # the template's own error: the client's request (C2)
            raise P.APIError(400, str(e), param="messages", code="chat_template_error") from None

    # ---- completions -----------------------------------------------------------------------------

    async def completions(self, request: Request):
        body = await _body(request, self.state, P.CompletionRequest)
        run = await _start_n(self.start_completion, request, body)
        return await _respond(run, body.stream, bool(body.stream_options and body.stream_options.include_usage))

    async def start_completion(self, request: Request, body: P.CompletionRequest) -> CompletionRun:
        """Check ``body`` and submit its generation on the model it names (as start_chat).
        Raises APIError (4xx, 503) as the completions route answers them."""
        return await self._on_model(request, body, self._start_completion)

    async def _start_completion(self, request: Request, body: P.CompletionRequest, slot: ModelSlot) -> CompletionRun:
        state = self.state
        engine, scheduler = slot.engine, slot.scheduler
        max_tokens, max_tokens_param = body.max_tokens_given()
        if max_tokens is None and max_tokens_param == "max_tokens":
            max_tokens = 16                            # OpenAI's default for completions
        _check_common(body, state, max_tokens, max_tokens_param)
        if body.logprobs is None and body.n_probs:     # llama-server's name for logprobs
            body.logprobs = body.n_probs
        if body.echo:
            raise P.APIError(400, "echo is not supported", param="echo", code="unsupported_value")
        if body.suffix:
            raise P.APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
            raise P.APIError(400, f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {body.logprobs}",
                             param="logprobs", code="invalid_value")
        params = _sampling(body, engine)
        grammar, grammar_param = body.constraint()
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            _too_long_to_tokenize(slot, len(prompt.encode()), "prompt")
            ids = await run_in_threadpool(engine.raw_prompt, prompt)
        else:
            n_vocab = engine.model.args.n_vocab
            bad = [t for t in prompt if not 0 <= t < n_vocab]
            if bad:
                raise P.APIError(400, f"prompt token {bad[0]} is not in the vocabulary (0..{n_vocab - 1})",
                                 param="prompt", code="invalid_value")
            ids = list(prompt)
        if not ids:
            raise P.APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        processors = await run_in_threadpool(_processors, grammar, grammar_param, engine, len(ids))
        gen = GenRequest(ids, params, emit=None, max_tokens=max_tokens, stop=body.stop_list(),
                         logprobs=body.logprobs, processors=processors, speculative=_speculative(body))
        gen.progress = body.progress
        stream = _Stream(scheduler, gen)
        try:
            stream.submit()
        except P.APIError as e:
            if e.code == "context_length_exceeded":
                e.param = "prompt"
            raise
        return CompletionRun(request, stream, engine, slot.name, body.logprobs)

    # ---- the rest --------------------------------------------------------------------------------

    async def models(self, request: Request):
        """GET /v1/models: the default model (started with -m), or every pulled model (router),
        each with its status (loaded / loading / unloaded) and context size."""
        state = self.state
        if not state.pool.router:
            engine, _ = state.require()
            return JSONResponse({"object": "list", "data": [_model_entry(state.pool.default, state)]})
        stored = await run_in_threadpool(state.stored_models)
        held = {s.path.resolve(): s for s in list(state.pool.slots.values())}
        data = []
        for info in stored:
            if info["error"] is not None:
                continue
            slot = held.pop(Path(info["path"]).resolve(), None)
            data.append(_model_entry(slot, state, info))
        data += [_model_entry(slot, state) for slot in held.values()]
        return JSONResponse({"object": "list", "data": data})

    async def load_model(self, request: Request):
        """POST /models/load {"model"}: load a pulled model now (router); answers once it is loaded."""
        body = await _body(request, self.state, P.ModelRequest)
        self._one_model_server("load")
        slot = await self.state.acquire(body.model, body.keep_alive_seconds())
        self.state.pool.release(slot)
        return JSONResponse({"success": True, "model": slot.name, "status": slot.status})

    async def unload_model(self, request: Request):
        """POST /models/unload {"model"}: unload a model now, or once its requests are done."""
        body = await _body(request, self.state, P.ModelRequest)
        self._one_model_server("unload")
        slot = await run_in_threadpool(self.state.pool.unload, body.model)
        return JSONResponse({"success": True, "model": slot.name, "status": slot.status})

    def _one_model_server(self, action: str) -> None:
        """400 for /models/load and /models/unload on a server started with -m: its one model
        stays loaded (unloading it left every request a 503), no other is served."""
        if not self.state.pool.router:
            raise P.APIError(400, f"this server serves one model (edge serve -m) and keeps it loaded: /models/{action} "
                                  "is for a server started without -m, which serves every pulled model",
                             param="model", code="unsupported_value")

    async def root(self, request: Request):
        """GET / and HEAD /: that edge is running, with the text Ollama's clients look for in it."""
        return Response(ROOT_TEXT, media_type="text/plain")

    async def _engine_of(self, model: str | None):
        """The engine of ``model`` (None: the default), loaded if needed and waited for, as a
        generation waits (ServerState.acquire; its 404 / 503)."""
        slot = await self.state.acquire(model)
        self.state.pool.release(slot)
        return slot.engine

    async def tokenize(self, request: Request):
        body = await _body(request, self.state, P.TokenizeRequest, MIN_TOKENIZE_BODY_LIMIT)
        engine = await self._engine_of(body.model)
        ids = await run_in_threadpool(engine.tokenizer.encode, body.content, body.add_special, body.parse_special)
        if body.with_pieces:                       # llama-server's [{"id", "piece"}]
            return JSONResponse({"tokens": P.token_pieces(engine.tokenizer, ids)})
        return JSONResponse({"tokens": [int(t) for t in ids]})

    async def detokenize(self, request: Request):
        body = await _body(request, self.state, P.DetokenizeRequest, MIN_TOKENIZE_BODY_LIMIT)
        engine = await self._engine_of(body.model)
        n_vocab = engine.model.args.n_vocab
        bad = [t for t in body.tokens if not 0 <= t < n_vocab]
        if bad:
            raise P.APIError(400, f"token {bad[0]} is not in the vocabulary (0..{n_vocab - 1})", param="tokens",
                             code="invalid_value")
        # special tokens as their text, as llama-server's /detokenize: /tokenize's ids round-trip
        raw = await run_in_threadpool(engine.tokenizer.decode, body.tokens, unparse_special=True)
        text = raw.decode("utf-8", errors="replace")
        return JSONResponse({"content": text})

    async def health(self, request: Request):
        if self.state.load_error:
            return JSONResponse({"status": "error", "error": self.state.load_error}, status_code=503)
        slot = self.state.pool.default
        loading = slot is None or not slot.ready.is_set()
        if loading and not (self.state.pool.router and (slot is None or self.state.started)):   # router: once started
            return JSONResponse({"status": "loading model"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request):
        return Response(generate_latest(self.state.metrics.registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


class RequestLog:
    """ASGI middleware: one line on stderr per request once its response has ended (method,
    route, model, status, prompt / cached / generated tokens, TTFT, duration; /health and
    /metrics are not logged) and, for requests that named a model, the outcome counter of
    /metrics (edge.server.metrics.outcome). Handlers leave ``edge_model`` and ``edge_run`` in
    request.state."""

    QUIET = ("/health", "/v1/health", "/metrics")

    def __init__(self, app, state: "ServerState", log: bool = True):
        self.app, self.state, self.log = app, state, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [0]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self._record(scope, status[0] or CLIENT_GONE, time.perf_counter() - t0)

    def _record(self, scope, status: int, seconds: float) -> None:
        info = scope.get("state") or {}
        model, run = info.get("edge_model"), info.get("edge_run")
        fin = run.fin if run is not None else None
        if run is not None and fin is None and status < 400:
            status = CLIENT_GONE                # a stream the client left before its end
        if scope.get("path") in self.QUIET:
            return
        if model or scope.get("method") == "POST":   # not the GETs that poll models, props, tags
            self.state.metrics.count(model or "", status)
        if not self.log:
            return
        asked = info.get("edge_asked")            # the name a refused request gave (not a metrics label)
        name = model or (repr(asked) if isinstance(asked, str) and asked else None)
        parts = [scope.get("method", ""), scope.get("path", ""), *([name] if name else []), str(status)]
        if fin is not None:
            parts.append(f"prompt={fin.prompt_tokens} cached={fin.cached_tokens} gen={fin.completion_tokens}")
            if fin.ttft is not None:
                parts.append(f"ttft={fin.ttft:.3f}s")
        parts.append(f"{seconds:.3f}s")
        print("edge serve: " + " ".join(parts), file=sys.stderr, flush=True)
