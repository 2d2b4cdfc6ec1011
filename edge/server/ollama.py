"""Ollama's API on `edge serve`, so tools written for Ollama (its Python and JS clients, curl
scripts) work unchanged. Shapes follow Ollama's docs/api.md (github.com/ollama/ollama) and its
api/types.go; generation goes through the OpenAI handlers (app._Handlers.start_chat /
start_completion) and their response dicts are translated.

Routes (:func:`routes`):

- ``POST /api/chat``: ``messages`` (role, content, tool_calls with ``arguments`` as an object,
  tool_name, tool_call_id; ``images`` are a 400), ``tools``, ``format`` ("json" or a JSON
  schema), ``options``, ``think``, ``logprobs`` / ``top_logprobs``, ``stream`` (default true:
  NDJSON lines, ``application/x-ndjson``), ``keep_alive``. No messages: the model is loaded
  (``done_reason: "load"``; with keep_alive 0, ``"unload"``).
- ``POST /api/generate``: ``prompt`` as a user message through the chat template (``system``
  before it), or with ``raw: true`` as it is; the same fields as chat but tools and messages.
  ``template``, ``suffix``, ``images`` and ``context`` (the deprecated token array) are 400s;
  no ``context`` is returned. An empty prompt loads or unloads the model as chat's empty messages.
- ``GET /api/tags`` (the pulled models, edge.store.list_models), ``POST /api/show``,
  ``GET /api/ps`` (the loaded models), ``GET /api/version``, ``GET /`` ("Ollama is running",
  the text clients compare). ``POST /api/pull`` answers success for a model already pulled;
  pulling from Ollama's registry, push, create, copy, delete and blobs are 501s.
- ``POST /api/embed`` and ``/api/embeddings``: edge.server.embeddings (ollama_routes).

The last object of a generation has ``done: true``, ``done_reason`` ("stop" or "length"; a
tool call ends with "stop" as Ollama's do), ``total_duration``, ``load_duration``,
``prompt_eval_duration``, ``eval_duration`` (nanoseconds), ``prompt_eval_count`` (the prompt's
tokens, cached ones included) and ``eval_count`` (tokens generated).

Options: num_predict (-1 or 0: no limit), temperature, top_k, top_p, min_p, repeat_penalty,
repeat_last_n, presence_penalty, frequency_penalty, seed (-1: random), stop, typical_p (1.0
only, as the OpenAI routes), draft_num_predict (speculative.n_max). Absent sampling options take
Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9, min_p 0, repeat_last_n 64,
repeat_penalty 1), not llama.cpp's. num_ctx is accepted and ignored: the server's ``-c`` is every
sequence's context (a longer prompt is a 400); the runner options (num_gpu, num_thread,
num_batch, use_mmap, ...) and names Ollama does not know are ignored, as Ollama does.

``keep_alive`` ("5m", "1h30m", seconds as a number, 0, negative: forever) is checked by
:func:`parse_keep_alive` and passed as given in the chat / completion request's ``keep_alive``
field (protocol._Sampling) for the model pool; with one model per server, "unload" is
answered and the model stays.

Errors are Ollama's ``{"error": "message"}`` with the status the OpenAI routes give (400 for a
bad request, 404 ``model "x" not found, try pulling it first``, 415 without
``Content-Type: application/json``, 503 while loading or when the queue is full); an error in
the middle of a stream is a last line ``{"error": "message"}``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import time
import traceback
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edge import __version__
from edge.server import app as A
from edge.server import protocol as P
from edge.server.protocol import parse_keep_alive

# The Ollama release whose API these routes follow (every /api/chat and /api/generate field
# served here, logprobs included, is in 0.12.11): clients compare /api/version with a minimum
# (VS Code's Copilot asks for 0.6.4), so edge's own version (0.1.0) would turn them away.
OLLAMA_API_VERSION = "0.12.11"
NDJSON = "application/x-ndjson"
_NS = 1_000_000_000
_SMALL_BODY = 1 << 20          # /api/show, /api/pull ...: a name and a few flags
_FOREVER = timedelta(days=365 * 292)   # Go's time.Duration(math.MaxInt64): "Forever" in `ollama ps`
# Ollama's DefaultOptions (api/types.go) for the sampling options a request leaves out
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_last_n": 64,
                   "repeat_penalty": 1.0}
_THINK_LEVELS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}   # max: Ollama's harmony mapping


# ---- request bodies -----------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


Number = float


class Options(_Body):
    """Ollama's ``options`` that change the answer (others are ignored, as Ollama does)."""

    num_predict: int | None = None
    temperature: Number | None = None
    top_k: int | None = None
    top_p: Number | None = None
    min_p: Number | None = None
    typical_p: Number | None = None
    repeat_penalty: Number | None = None
    repeat_last_n: int | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    draft_num_predict: Annotated[int, Field(ge=0)] | None = None


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
                    "presence_penalty", "frequency_penalty", "seed", "stop")


class ToolCallFunction(_Body):
    name: str
    arguments: dict | str = Field(default_factory=dict)


class ToolCall(_Body):
    id: str | None = None
    function: ToolCallFunction


class Message(_Body):
    role: str
    content: str | None = ""
    thinking: str | None = None     # an earlier answer's reasoning: not sent back to the template
    images: list | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Generation(_Body):
    model: str = ""
    format: str | dict | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: Number | str | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class ChatBody(_Generation):
    messages: list[Message] = Field(default_factory=list)
    tools: list | None = None


class GenerateBody(_Generation):
    prompt: str = ""
    system: str | None = None
    template: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list | None = None
    context: list[int] | None = None


class NameBody(_Body):
    """/api/show, /api/pull: ``model`` (or ``name``, its older spelling)."""

    model: str = ""
    name: str = ""
    verbose: bool = False
    stream: bool = True

    def model_name(self) -> str:
        return self.model or self.name


# ---- values -------------------------------------------------------------------------------------

def edge_name(name: str) -> str:
    """A model name as the server knows it: Ollama's default tag ``:latest`` removed."""
    return name[: -len(":latest")] if name.endswith(":latest") else name


def ollama_name(name: str) -> str:
    """A store name with a tag, as Ollama lists models: ``:latest`` added unless it has one."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def _now() -> str:
    return _timestamp(datetime.now(timezone.utc))


def _timestamp(t: datetime) -> str:
    """RFC 3339 in UTC with microseconds, as Go's time.Time marshals (``2024-06-04T14:38:31.837530Z``)."""
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(seconds: float) -> int:
    return max(0, int(round(seconds * _NS)))


def human_number(n: int) -> str:
    """A parameter count as Ollama writes it (format.HumanNumber): 7.6B, 494.03M, 135M, 12K."""
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f}{unit}" if x == math.floor(x) else f"{x:.{digits}f}{unit}"
    return f"{n / 1e3:.0f}K" if n >= 1000 else str(n)


# ---- errors -------------------------------------------------------------------------------------

def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    """Ollama's error: ``{"error": message}`` with ``status``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _ollama_errors(handler):
    """Answer APIError (and any other exception, as a 500) in Ollama's shape."""
    @functools.wraps(handler)
    async def wrapped(self, request: Request):
        try:
            return await handler(self, request)
        except P.APIError as e:
            return error(e.status, e.message, e.headers)
        except Exception as e:   # a bug: the server goes on
            traceback.print_exc()
            return error(500, f"internal error: {type(e).__name__}: {e}")
    return wrapped


def _validate(cls, data: dict):
    """``cls.model_validate(data)``; a ValidationError is a 400 naming the field (a sampling
    field as options.NAME, where the request gave it)."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = P.validation_error(e)
        if err.param and err.param.split(".")[0] in SAMPLING_OPTIONS:
            err.message = f"options.{err.message}"
            err.param = f"options.{err.param}"
        raise err from None


async def _small_body(request: Request, cls):
    """A small JSON body (at most 1 MiB) as ``cls``: 415 unless application/json, 413 past
    1 MiB, 400 for bad JSON or fields."""
    P.check_content_type(request.headers.get("content-type"))
    raw = b""
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > _SMALL_BODY:
                raise P.APIError(413, f"the request body is larger than {_SMALL_BODY} bytes", code="request_too_large")
    except ClientDisconnect:
        raise P.APIError(A.CLIENT_GONE, "the client went away", code="client_gone") from None
    return _validate(cls, P.parse_json_object(raw))


# ---- the model file's facts (tags, show, ps) ----------------------------------------------------

@functools.lru_cache(maxsize=64)
def _facts(path: str, size: int, mtime_ns: int) -> dict:
    """What Ollama's model routes show of a GGUF file, read once per file version: details,
    the chat template, capabilities, license, model_info (the scalar values; arrays as [])."""
    import gguf

    from edge.gguf_file import GGUFFile
    from edge.reasoning import CLOSE_TAG, OPEN_TAG, template_mentions_reasoning

    gf = GGUFFile(path)
    try:
        md = gf.metadata
        arch = gf.architecture
        n_params = sum(t.n_elements for t in gf.tensors.values())
        tokens = md.get("tokenizer.ggml.tokens") or []
        think_tokens = OPEN_TAG in tokens and CLOSE_TAG in tokens
        template = md.get("tokenizer.chat_template")
        info: dict[str, Any] = {"general.parameter_count": n_params}
        for key, value in md.items():
            if key == "tokenizer.chat_template":
                continue
            info[key] = _json_scalar(value)
    finally:
        gf.close()
    try:
        ftype = gguf.LlamaFileType(md.get("general.file_type")).name
        quant = ftype.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (ValueError, TypeError):
        quant = "unknown"
    capabilities = ["completion"]
    if template and "tools" in template:
        capabilities.append("tools")
    if template_mentions_reasoning(template) or think_tokens:
        capabilities.append("thinking")
    details = {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
               "parameter_size": human_number(n_params), "quantization_level": quant}
    return {"details": details, "template": template or "", "capabilities": capabilities, "model_info": info,
            "license": md.get("general.license")}


def _json_scalar(value):
    """A metadata value for JSON: arrays become [] (Ollama's model_info without verbose)."""
    if isinstance(value, (np.ndarray, list, tuple)):
        return []
    return value.item() if isinstance(value, np.generic) else value


def _file_facts(path: Path) -> dict:
    st = path.stat()
    return _facts(str(path), st.st_size, st.st_mtime_ns)


def _digest(path: Path, registered_sha256: str | None = None) -> str:
    """The registry's SHA-256 of the file for a registered model, else a SHA-256 of the file's
    path, size and mtime (an identity that changes when the file does; hashing gigabytes per
    listing would not do)."""
    if registered_sha256:
        return registered_sha256
    st = path.stat()
    return hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()


class _Catalog:
    """The pulled models readable by edge (ServerState.stored_models, read again only when a
    store file changes) with their Ollama digest, computed once per listing."""

    def __init__(self, state):
        self._state = state
        self._source: list | None = None
        self._models: list[dict] = []

    def models(self) -> list[dict]:
        from edge.store import find_entry

        stored = self._state.stored_models()
        if stored is not self._source:
            out = []
            for m in stored:
                if m["error"] is not None:       # a file edge cannot read is not listed
                    continue
                entry = find_entry(m["path"].stem)
                sha = entry.sha256 if entry is not None and entry.name == m["path"].stem else None
                out.append({**m, "digest": _digest(m["path"], sha)})
            self._source, self._models = stored, out
        return self._models

    def find(self, name: str) -> dict | None:
        """The pulled model ``name`` names (its store name, file stem or a registry alias)."""
        from edge.store import find_entry

        name = edge_name(name)
        entry = find_entry(name)
        for m in self.models():
            if name in (m["name"], m["path"].stem) or (entry is not None and entry.name == m["path"].stem):
                return m
        return None


# ---- translation of the OpenAI dicts ------------------------------------------------------------

def _done_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"    # "tool_calls" ends as Ollama's: "stop"


def _arguments(text: str) -> dict:
    """A tool call's arguments (JSON text) as the object Ollama sends."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _ollama_call(call: dict, index: int) -> dict:
    return {"id": call["id"], "function": {"index": index, "name": call["function"]["name"],
                                           "arguments": _arguments(call["function"]["arguments"])}}


def _completion_logprobs(block: dict | None) -> list[dict]:
    """OpenAI completions' logprobs block as Ollama's list of {token, logprob, top_logprobs}."""
    if not block:
        return []
    return [{"token": t, "logprob": lp, "top_logprobs": [{"token": k, "logprob": v} for k, v in (top or {}).items()]}
            for t, lp, top in zip(block["tokens"], block["token_logprobs"], block["top_logprobs"])]


class _Piece:
    """A piece of an answer: content, thinking, finished tool calls, logprobs, finish reason."""

    __slots__ = ("content", "thinking", "calls", "logprobs", "finish")

    def __init__(self, content="", thinking="", calls=(), logprobs=(), finish=None):
        self.content, self.thinking, self.calls = content, thinking, list(calls)
        self.logprobs, self.finish = list(logprobs), finish

    def __bool__(self):
        return bool(self.content or self.thinking or self.calls or self.logprobs)


def _whole(response: dict, chat: bool) -> _Piece:
    """The whole answer of a chat.completion or text_completion dict."""
    choice = response["choices"][0]
    if not chat:
        return _Piece(choice["text"], logprobs=_completion_logprobs(choice["logprobs"]), finish=choice["finish_reason"])
    msg = choice["message"]
    calls = [_ollama_call(c, i) for i, c in enumerate(msg.get("tool_calls") or [])]
    lps = (choice.get("logprobs") or {}).get("content") or []
    return _Piece(msg.get("content") or "", msg.get("reasoning_content") or "", calls, lps, choice["finish_reason"])


async def _pieces(run, chat: bool):
    """The streamed pieces of a ChatRun's chunks (a tool call once its arguments arrive) or a
    CompletionRun's."""
    started: dict[int, dict] = {}       # tool call index -> its first delta (id, name)
    async for chunk in run.chunks():
        choice = chunk["choices"][0]
        if not chat:
            yield _Piece(choice["text"], logprobs=_completion_logprobs(choice["logprobs"]),
                         finish=choice["finish_reason"])
            continue
        delta = choice["delta"]
        calls = []
        for tc in delta.get("tool_calls") or []:
            if "id" in tc:
                started[tc["index"]] = tc
            else:                                     # the arguments: the call is whole
                first = started[tc["index"]]
                calls.append(_ollama_call({"id": first["id"], "function": {
                    "name": first["function"]["name"], "arguments": tc["function"]["arguments"]}}, tc["index"]))
        lps = (choice.get("logprobs") or {}).get("content") or []
        yield _Piece(delta.get("content") or "", delta.get("reasoning_content") or "", calls, lps,
                     choice["finish_reason"])


def _shape(piece: _Piece, chat: bool) -> dict:
    """The fields of ``piece`` in a chat (``message``) or generate (``response``) object."""
    if chat:
        message = {"role": "assistant", "content": piece.content}
        if piece.thinking:
            message["thinking"] = piece.thinking
        if piece.calls:
            message["tool_calls"] = piece.calls
        out = {"message": message}
    else:
        out = {"response": piece.content}
        if piece.thinking:
            out["thinking"] = piece.thinking
    if piece.logprobs:
        out["logprobs"] = piece.logprobs
    return out


def _stats(run, t0: float, load_seconds: float) -> dict:
    """The durations (ns) and counts of a finished run."""
    fin = run.timing()
    return {"total_duration": _ns(time.perf_counter() - t0), "load_duration": _ns(load_seconds),
            "prompt_eval_count": fin.prompt_tokens, "prompt_eval_duration": _ns(fin.prompt_seconds),
            "eval_count": fin.completion_tokens, "eval_duration": _ns(fin.generation_seconds)}


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


# ---- the routes ---------------------------------------------------------------------------------

class _Ollama:
    """The handlers of Ollama's routes over the OpenAI handlers ``h`` (app._Handlers)."""

    def __init__(self, h):
        self.h, self.state = h, h.state
        self.catalog = _Catalog(self.state)

    # ---- helpers --------------------------------------------------------------------------------

    async def _require(self, name: str, keep_alive=None, check=None):
        """(engine, seconds its load took) of the model ``name`` (a tag such as :latest allowed),
        loaded by the model pool if needed (edge.server.pool). Raises APIError: 400 without a
        name, 404 in Ollama's words, 503 while it loads past --load-timeout."""
        if not name:
            raise P.APIError(400, "model is required", param="model", code="invalid_value")
        t = time.perf_counter()
        try:
            slot = await self.state.acquire(edge_name(name), "default" if keep_alive is None
                                            else parse_keep_alive(keep_alive), any_name=False, check=check)
        except P.APIError as e:
            if e.code == "model_not_found":
                raise P.APIError(404, f'model "{name}" not found, try pulling it first', param="model",
                                 code="model_not_found") from None
            if e.code == "no_chat_template":
                e.message = (f'"{name}" has no chat template, so it cannot take chat messages; send the text to '
                             "/api/generate with raw: true")
            raise
        self.state.pool.release(slot)
        return slot.engine, time.perf_counter() - t

    async def _read(self, request: Request, cls):
        return await A._body(request, self.state, cls)

    @staticmethod
    def _sampling(body: _Generation) -> dict:
        """The chat / completion request's fields for ``body``'s options (Ollama's defaults
        for the sampling options left out) and keep_alive (as given; 400 if not a duration)."""
        opts = body.options or Options()
        fields = dict(OLLAMA_DEFAULTS)
        fields.update({k: getattr(opts, k) for k in SAMPLING_OPTIONS if getattr(opts, k) is not None})
        fields["n_predict"] = opts.num_predict if opts.num_predict is not None and opts.num_predict > 0 else -1
        if opts.draft_num_predict is not None:
            fields["speculative.n_max"] = opts.draft_num_predict
        if body.keep_alive is not None:
            parse_keep_alive(body.keep_alive)        # a 400 now for a value that is not a duration
        fields["keep_alive"] = body.keep_alive      # as given, for the model pool
        return fields

    @staticmethod
    def _logprobs(body: _Generation, chat: bool) -> dict:
        """The chat request's logprobs / top_logprobs (``chat``) or the completion's logprobs
        count. Raises APIError 400 for top_logprobs outside 0..20 (Ollama's words)."""
        n = body.top_logprobs
        if n is not None and not 0 <= n <= A.MAX_TOP_LOGPROBS:
            raise P.APIError(400, f"top_logprobs must be between 0 and {A.MAX_TOP_LOGPROBS}", param="top_logprobs",
                             code="invalid_value")
        if not (body.logprobs or n):
            return {}
        return {"logprobs": True, "top_logprobs": n or 0} if chat else {"logprobs": n or 0}

    def _think(self, body: _Generation, engine, name: str) -> dict:
        """The chat request's fields for ``think``: false turns reasoning off, a level is the
        template's reasoning_effort. Raises APIError 400 for another value, or think on for a
        model that does not reason (Ollama's ``"x" does not support thinking``)."""
        from edge.reasoning import is_reasoning_model

        think = body.think
        if think is None:
            return {}
        if isinstance(think, str) and think not in _THINK_LEVELS:
            raise P.APIError(400, f"think: {think!r} is not a thinking value (true, false, \"low\", \"medium\", "
                                  "\"high\", \"max\")", param="think", code="invalid_value")
        if think is not False:
            source = engine.template.source if engine.template is not None else None
            if not is_reasoning_model(source, engine.tokenizer):
                raise P.APIError(400, f'"{name}" does not support thinking', param="think", code="invalid_value")
        if think is False:
            return {"reasoning_effort": "none"}
        return {"reasoning_effort": _THINK_LEVELS[think]} if isinstance(think, str) else {}

    @staticmethod
    def _format(fmt, chat: bool) -> dict:
        """``format`` as the chat request's response_format or the completion's json_schema."""
        if fmt is None or fmt == "":
            return {}
        if fmt == "json":
            return {"response_format": {"type": "json_object"}} if chat else {"json_schema": {"type": "object"}}
        if isinstance(fmt, dict):
            return ({"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
                    if chat else {"json_schema": fmt})
        raise P.APIError(400, f'format: {fmt!r} is not a format: give "json" or a JSON schema (an object)',
                         param="format", code="invalid_value")

    async def _loaded_answer(self, body: _Generation, chat: bool) -> JSONResponse:
        """The answer to a request without messages / prompt: the model loaded ("load") or,
        with keep_alive 0, unloaded ("unload"; at once when idle, else after its requests;
        a server started with -m keeps its one model)."""
        unload = body.keep_alive is not None and parse_keep_alive(body.keep_alive) == 0
        if unload:
            if not body.model:
                raise P.APIError(400, "model is required", param="model", code="invalid_value")
            if self.state.pool.router:
                try:
                    await run_in_threadpool(self.state.pool.unload, edge_name(body.model))
                except P.APIError:
                    pass                     # not loaded: nothing to unload, as Ollama answers
        else:
            await self._require(body.model, body.keep_alive)
        reason = "unload" if unload else "load"
        out = {"model": body.model, "created_at": _now()}
        out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        return JSONResponse({**out, "done": True, "done_reason": reason})

    @staticmethod
    async def _start(start, request: Request, req, name: str):
        """``start(request, req)`` (start_chat / start_completion) with its errors in Ollama's
        words: a sampling field is named options.NAME."""
        try:
            return await start(request, req)
        except P.APIError as e:
            if e.param in SAMPLING_OPTIONS:
                if e.message.startswith(e.param):
                    e.message = f"options.{e.message}"
                e.param = f"options.{e.param}"
            elif e.code == "no_chat_template":
                e.message = (f'"{name}" has no chat template, so it cannot take chat messages; send the text to '
                             "/api/generate with raw: true")
            raise

    @staticmethod
    async def _answer(run, body: _Generation, chat: bool, t0: float, load_s: float):
        """The run's answer as /api/chat's (``chat``) or /api/generate's objects: one, or
        NDJSON lines then the done object."""
        head, is_chat_run = {"model": body.model}, isinstance(run, A.ChatRun)
        if not body.stream:
            out = await run.complete()
            if out is None:
                return Response(status_code=A.CLIENT_GONE)
            piece = _whole(out, is_chat_run)
            return JSONResponse({**head, "created_at": _now(), **_shape(piece, chat), "done": True,
                                 "done_reason": _done_reason(piece.finish), **_stats(run, t0, load_s)})

        async def objects():
            reason = None
            async for piece in _pieces(run, is_chat_run):
                reason = piece.finish or reason
                if piece:
                    yield {**head, "created_at": _now(), **_shape(piece, chat), "done": False}
            yield {**head, "created_at": _now(), **_shape(_Piece(), chat), "done": True,
                   "done_reason": _done_reason(reason), **_stats(run, t0, load_s)}

        return await _ndjson(objects(), run)

    # ---- generation -----------------------------------------------------------------------------

    @_ollama_errors
    async def chat(self, request: Request):
        """POST /api/chat (module docstring)."""
        t0 = time.perf_counter()
        body: ChatBody = await self._read(request, ChatBody)
        if not body.messages:
            return await self._loaded_answer(body, chat=True)
        engine, load_s = await self._require(body.model, body.keep_alive, A.has_chat_template)
        messages = []
        for i, m in enumerate(body.messages):
            if m.images:
                raise P.APIError(400, f"messages[{i}].images: images are not supported (edge serves text models)",
                                 param=f"messages.{i}.images", code="unsupported_content")
            out: dict = {"role": m.role.lower(), "content": m.content}
            if m.tool_calls:
                out["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for j, c in enumerate(m.tool_calls)]
            if m.tool_name is not None:
                out["name"] = m.tool_name
            if m.tool_call_id is not None:
                out["tool_call_id"] = m.tool_call_id
            messages.append(out)
        fields = self._sampling(body)
        if body.tools:
            source = engine.template.source if engine.template is not None else ""
            if "tools" not in source:
                raise P.APIError(400, f'"{body.model}" does not support tools', param="tools", code="invalid_value")
            fields["tools"] = body.tools
        fields.update(self._format(body.format, chat=True))
        fields.update(self._think(body, engine, body.model))
        fields.update(self._logprobs(body, chat=True))
        req = _validate(P.ChatCompletionRequest, {**fields, "model": edge_name(body.model), "messages": messages})
        run = await self._start(self.h.start_chat, request, req, body.model)
        return await self._answer(run, body, True, t0, load_s)

    @_ollama_errors
    async def generate(self, request: Request):
        """POST /api/generate (module docstring)."""
        t0 = time.perf_counter()
        body: GenerateBody = await self._read(request, GenerateBody)
        for name in ("template", "suffix"):
            if getattr(body, name):
                why = ("edge renders the model's own chat template (Jinja); send the prompt already formatted "
                       "with raw: true" if name == "template" else "fill-in-the-middle is not served")
                raise P.APIError(400, f"{name} is not supported: {why}", param=name, code="unsupported_value")
        if body.images:
            raise P.APIError(400, "images are not supported (edge serves text models)", param="images",
                             code="unsupported_content")
        if body.context:
            raise P.APIError(400, "context (the deprecated token array) is not supported: send the conversation "
                                  "to /api/chat as messages", param="context", code="unsupported_value")
        if body.raw and body.system:
            raise P.APIError(400, "raw mode does not support template, system, or context", param="system",
                             code="invalid_value")
        if not body.prompt:
            return await self._loaded_answer(body, chat=False)
        engine, load_s = await self._require(body.model, body.keep_alive)
        fields = self._sampling(body)
        raw = body.raw or engine.template is None    # no template: the prompt as is (Ollama's {{ .Prompt }})
        if raw and body.system:
            raise P.APIError(400, f'system: "{body.model}" has no chat template to place a system prompt in',
                             param="system", code="invalid_value")
        fields.update(self._format(body.format, chat=not raw))
        fields.update(self._logprobs(body, chat=not raw))
        fields["model"] = edge_name(body.model)
        if raw:
            req = _validate(P.CompletionRequest, {**fields, "prompt": body.prompt})
            run = await self._start(self.h.start_completion, request, req, body.model)
        else:
            fields.update(self._think(body, engine, body.model))
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                [{"role": "user", "content": body.prompt}]
            req = _validate(P.ChatCompletionRequest, {**fields, "messages": messages})
            run = await self._start(self.h.start_chat, request, req, body.model)
        return await self._answer(run, body, False, t0, load_s)

    # ---- models ---------------------------------------------------------------------------------

    def _entry(self, m: dict) -> dict:
        facts = _file_facts(m["path"])
        name = ollama_name(m["name"])
        return {"name": name, "model": name,
                "modified_at": _timestamp(datetime.fromtimestamp(m["path"].stat().st_mtime, timezone.utc)),
                "size": m["size"], "digest": m["digest"], "details": facts["details"]}

    @_ollama_errors
    async def tags(self, request: Request):
        """GET /api/tags: the pulled models (``{"models": [{name, model, modified_at, size,
        digest, details}]}``), names tagged ``:latest`` unless the store's name has a tag."""
        def listing():
            models = self.catalog.models()
            pool = self.state.pool
            if not pool.router:      # -m: the one model served here (the chat routes answer 404 for the others)
                path = pool.default_path.resolve() if pool.default_path is not None else None
                models = [m for m in models if m["path"].resolve() == path]
                if not models and path is not None and pool.default is not None:     # -m FILE outside the store
                    models = [{"name": pool.default.name, "path": path, "size": path.stat().st_size,
                               "digest": _digest(path, None)}]
            return [self._entry(m) for m in models]
        return JSONResponse({"models": await run_in_threadpool(listing)})

    def _loaded_path(self, name: str) -> Path | None:
        """The file of a loaded model named ``name`` (one not in the store: `-m FILE`)."""
        return next((Path(m["engine"].path) for m in self.state.loaded() if m["name"] == edge_name(name)), None)

    @_ollama_errors
    async def show(self, request: Request):
        """POST /api/show ``{"model"}``: modelfile, parameters (num_ctx: the server's context),
        template (the GGUF's Jinja chat template), details, model_info (the GGUF's metadata with
        general.parameter_count; arrays as [] unless ``verbose``), capabilities ("completion",
        "tools" when the template renders tools, "thinking"), modified_at. 404 for a model that
        is neither pulled nor loaded."""
        body = await _small_body(request, NameBody)
        name = body.model_name()
        if not name:
            raise P.APIError(400, "model is required", param="model")

        def read():
            m = self.catalog.find(name)
            path = m["path"] if m is not None else self._loaded_path(name)
            if path is None:
                raise P.APIError(404, f'model "{name}" not found', param="model", code="model_not_found")
            facts = _file_facts(path)
            info = {**facts["model_info"], **_arrays(path)} if body.verbose else facts["model_info"]
            return path, facts, info
        path, facts, info = await run_in_threadpool(read)
        n_ctx = self.state.config.n_ctx
        modelfile = (f"# Modelfile generated by edge\n# The chat template is the GGUF's Jinja template (see "
                     f"\"template\"), not Ollama's Go template.\nFROM {path}\nPARAMETER num_ctx {n_ctx}\n")
        out = {"modelfile": modelfile, "parameters": f"{'num_ctx':<30} {n_ctx}", "template": facts["template"],
               "details": facts["details"], "model_info": info, "capabilities": facts["capabilities"],
               "modified_at": _timestamp(datetime.fromtimestamp(path.stat().st_mtime, timezone.utc))}
        if facts["license"]:
            out["license"] = facts["license"]
        return JSONResponse(out)

    @_ollama_errors
    async def ps(self, request: Request):
        """GET /api/ps: the loaded models (name, model, size: the file's bytes, digest,
        details, expires_at (far in the future when kept), size_vram 0, context_length)."""
        def listing():
            out = []
            for m in self.state.loaded():
                path = Path(m["engine"].path)
                pulled = self.catalog.find(m["name"])
                name = ollama_name(m["name"])
                expires = (datetime.fromtimestamp(m["expires_at"], timezone.utc) if m["expires_at"] is not None
                           else datetime.now(timezone.utc) + _FOREVER)
                out.append({"name": name, "model": name, "size": path.stat().st_size,
                            "digest": pulled["digest"] if pulled is not None else _digest(path),
                            "details": _file_facts(path)["details"], "expires_at": _timestamp(expires),
                            "size_vram": 0, "context_length": m["engine"].n_ctx})
            return out
        return JSONResponse({"models": await run_in_threadpool(listing)})

    async def version(self, request: Request):
        """GET /api/version: ``{"version": OLLAMA_API_VERSION, "edge_version": edge's}``."""
        return JSONResponse({"version": OLLAMA_API_VERSION, "edge_version": __version__})

    @_ollama_errors
    async def pull(self, request: Request):
        """POST /api/pull: success (``{"status": "success"}``, streamed as one line unless
        ``stream`` is false) for a model already pulled; 501 otherwise (Ollama's registry is
        not edge's: `edge pull NAME`)."""
        body = await _small_body(request, NameBody)
        name = body.model_name()
        if not name:
            raise P.APIError(400, "model is required", param="model")
        if self.catalog.find(name) is None:
            raise P.APIError(501, f'edge does not pull from Ollama\'s registry: "{name}" is not pulled; pull it '
                                  "with `edge pull NAME` (a name `edge pull` knows, or hf.co/USER/REPO[:QUANT])")
        if not body.stream:
            return JSONResponse({"status": "success"})
        return Response(_line({"status": "success"}), media_type=NDJSON)

    async def not_served(self, request: Request):
        """Ollama's routes edge does not serve: 501 in Ollama's shape, saying why."""
        what = {"/api/push": "push models to a registry", "/api/create": "create models from Modelfiles",
                "/api/copy": "copy models", "/api/delete": "delete models (remove the file from ~/.cache/edge/models)",
                "/api/embed": "serve embeddings", "/api/embeddings": "serve embeddings"}
        path = request.url.path
        reason = "take model blobs (models are created by edge pull)" if path.startswith("/api/blobs/") \
            else what.get(path, path)
        return error(501, f"{path}: edge does not {reason}")


def _arrays(path: Path) -> dict:
    """The GGUF's array metadata values (tokens, merges, ...), for /api/show verbose."""
    from edge.gguf_file import GGUFFile

    gf = GGUFFile(path)
    try:
        return {k: v.tolist() if isinstance(v, np.ndarray) else list(v)
                for k, v in gf.metadata.items() if isinstance(v, (np.ndarray, list, tuple))}
    finally:
        gf.close()


async def _ndjson(objects, run) -> Response:
    """NDJSON lines of ``objects`` (an async iterator of dicts). The first is awaited before
    answering, so an error before any output keeps its status (as Ollama's streamResponse);
    a later one becomes a last line ``{"error": ...}``. The run is cancelled when the stream
    ends early (the client went away)."""
    it = objects.__aiter__()
    try:
        first = await it.__anext__()
    except BaseException:
        run.cancel()
        raise

    async def lines():
        try:
            yield _line(first)
            async for obj in it:
                yield _line(obj)
        except P.APIError as e:
            yield _line({"error": e.message})
        finally:
            run.cancel()

    return StreamingResponse(lines(), media_type=NDJSON, headers={"Cache-Control": "no-cache",
                                                                  "X-Accel-Buffering": "no"})


def routes(h, extra=lambda o: []) -> list[Route]:
    """Ollama's routes over the OpenAI handlers ``h`` (app._Handlers); ``extra(o)`` gives more
    routes over the Ollama handlers ``o`` (edge.server.embeddings.ollama_routes: /api/embed,
    /api/embeddings; passed in by edge.server.asgi, since embeddings builds on this module)."""
    o = _Ollama(h)
    return [
        Route("/api/chat", o.chat, methods=["POST"]),
        Route("/api/generate", o.generate, methods=["POST"]),
        Route("/api/tags", o.tags, methods=["GET"]),
        Route("/api/show", o.show, methods=["POST"]),
        Route("/api/ps", o.ps, methods=["GET"]),
        Route("/api/version", o.version, methods=["GET"]),
        Route("/api/pull", o.pull, methods=["POST"]),
        *extra(o),                       # /api/embed, /api/embeddings
        *(Route(p, o.not_served, methods=["POST", "DELETE"])
          for p in ("/api/push", "/api/create", "/api/copy", "/api/delete")),
        Route("/api/blobs/{digest}", o.not_served, methods=["POST", "HEAD"]),
    ]
