"""Anthropic's Messages API on `edge serve` (what Claude Code and the `anthropic` client speak):
POST /v1/messages and POST /v1/messages/count_tokens.

Formats: Anthropic's API reference (Messages, Streaming Messages, Count tokens, Errors) and the
types of the anthropic Python SDK (anthropic.types: Message, RawMessageStreamEvent, Usage ...).
A request is translated into a chat completion (edge.server.app._Handlers.start_chat) and the
answer back:

- ``system`` (a string or text blocks) becomes a system message; ``messages`` hold a string or
  blocks: ``text``; an assistant's ``tool_use`` (its ``input`` object) becomes a tool call and
  a user's ``tool_result`` a ``role: "tool"`` message (``is_error``: its text after "Error: ");
  ``thinking`` blocks given back are dropped (the chat templates drop past reasoning too).
  Blocks are joined with a blank line. ``image``, ``document`` and other blocks: 400.
  A last message from the assistant (a prefill to continue) is a 400: not served.
- ``max_tokens`` (required), ``stop_sequences`` (at most 16), ``temperature``, ``top_p``,
  ``top_k``; ``tools`` (custom tools: name, description, input_schema; server tools such as
  web_search: 400) and ``tool_choice`` (auto, any, tool, none; ``disable_parallel_tool_use``);
  ``thinking`` {type: disabled} turns a reasoning model's thinking off (enabled / adaptive,
  or no ``thinking``: the model's default; ``budget_tokens`` is not enforced per request, the
  server's --reasoning-budget is); ``output_config.format`` (or the older ``output_format``)
  {type: json_schema, schema} constrains the answer to the schema; ``output_config.effort``
  reaches the chat template as ``reasoning_effort`` (max: xhigh). ``metadata``,
  ``service_tier``, ``cache_control`` are accepted and change nothing.
- The answer: ``{"id": "msg_...", "type": "message", "role": "assistant", "model", "content":
  [thinking?, text, tool_use...], "stop_reason", "stop_sequence", "usage"}``; stop_reason
  end_turn, max_tokens (the limit or the context), stop_sequence (the scheduler's Finished names
  the string that matched) or tool_use. usage in tokens as Anthropic counts them:
  ``input_tokens`` excludes the prompt tokens read from the prefix cache
  (``cache_read_input_tokens``); ``cache_creation_input_tokens`` is 0.
- Streamed: ``event:``-named server-sent events message_start (input_tokens: the whole prompt
  until message_delta splits off the cached part), ping, per block content_block_start /
  content_block_delta (text_delta, thinking_delta, input_json_delta: a call's input arrives in
  one partial_json when the call closes) / content_block_stop, message_delta (stop_reason,
  usage), message_stop. A failure mid-stream is ``event: error``.
- Errors: ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's statuses and
  types (400 invalid_request_error, 401 authentication_error, 403 permission_error, 404
  not_found_error, 413 request_too_large, 500 api_error, 529 overloaded_error for a full queue
  or a model still loading, with Retry-After); the app renders every error under /v1/messages
  so (:func:`error_response`), also the API key's and the Host guard's.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge.server import protocol as P
from edge.server.adapter import Blocks, chat_body, event_stream, function_tool, outcome, renaming, sse, \
    tool_arguments
from edge.server.app import CLIENT_GONE, _body, has_chat_template

PREFIX = "/v1/messages"
_SEP = "\n\n"      # between text blocks of one message (and of the system prompt)


def serves(path: str) -> bool:
    """True for the paths whose errors take Anthropic's shape."""
    return path == PREFIX or path.startswith(PREFIX + "/")


# ---- errors -------------------------------------------------------------------------------------

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
          529: "overloaded_error"}
_OVERLOADED = {"queue_full", "loading", "shutting_down", "models_busy"}   # 503s a retry may get past


def _status(err: P.APIError) -> int:
    if err.status == 503:
        return 529 if err.code in _OVERLOADED else 500
    return err.status


def error_body(err: P.APIError) -> dict:
    """``{"type": "error", "error": {"type", "message"}}`` for ``err`` (Anthropic's Errors page);
    the shape has no ``param``, so the message starts with the field it names."""
    status = _status(err)
    kind = _TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    message = err.message if not err.param or err.message.startswith(err.param) else f"{err.param}: {err.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(path: str, err: P.APIError) -> Response:
    """``err`` as Anthropic answers it: its status (503 -> 529 overloaded / 500) and shape."""
    return JSONResponse(error_body(err), status_code=_status(err), headers=err.headers)


# names of the chat request's fields in errors -> this API's
_NAMES = [(r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"), (r"tools\.(\d+)\.function\.", r"tools.\1."),
          (r"stop\b", "stop_sequences"), (r"response_format", "output_config.format")]


# ---- the request --------------------------------------------------------------------------------

class AnthropicMessage(P._Body):
    role: Literal["user", "assistant"]
    content: str | list[dict]


class MessagesRequest(P._Body):
    """A POST /v1/messages (or count_tokens) body; fields not listed are ignored."""

    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    max_tokens: int | None = None           # required by /v1/messages (checked there)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[P.Number, Field(ge=0, le=1)] | None = None
    top_p: Annotated[P.Number, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None
    output_format: dict | None = None
    metadata: dict | None = None
    mcp_servers: list | None = None
    container: Any = None


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise P.APIError(400, f"{where}.text: a text block needs its text (a string)", param=f"{where}.text",
                         code="invalid_value")
    return text


def _unsupported(kind, where: str) -> P.APIError:
    return P.APIError(400, f"{where}: content blocks of type {json.dumps(kind)} are not supported by this server "
                           "(text, tool_use, tool_result and thinking only)", param=f"{where}.type",
                      code="unsupported_content")


def _system(system, where: str = "system") -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for j, block in enumerate(system):
        if block.get("type") != "text":
            raise _unsupported(block.get("type"), f"{where}.{j}")
        texts.append(_text_of(block, f"{where}.{j}"))
    return _SEP.join(texts)


def _tool_result(block: dict, where: str) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise P.APIError(400, f"{where}.tool_use_id: a tool_result needs the id of its tool_use",
                         param=f"{where}.tool_use_id", code="invalid_value")
    content = block.get("content", "")
    text = content if isinstance(content, str) else _system(content, f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tool_use(block: dict, where: str) -> dict:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
        raise P.APIError(400, f"{where}: a tool_use block needs id and name (strings) and input (an object)",
                         param=where, code="invalid_value")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _chat_messages(m: AnthropicMessage, where: str) -> list[dict]:
    """The chat messages of one Anthropic message (a user's tool results become tool messages,
    in their order; an assistant's tool_use blocks its tool_calls)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out, texts, calls = [], [], []
    for j, block in enumerate(m.content):
        at, kind = f"{where}.content.{j}", block.get("type")
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_result" and m.role == "user":
            if texts:
                out.append({"role": "user", "content": _SEP.join(texts)})
                texts = []
            out.append(_tool_result(block, at))
        elif kind == "tool_use" and m.role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
            continue
        else:
            raise _unsupported(kind, at)
    if m.role == "assistant":
        out.append({"role": "assistant", "content": _SEP.join(texts), **({"tool_calls": calls} if calls else {})})
    elif texts or not out:
        out.append({"role": "user", "content": _SEP.join(texts)})
    return out


def _tools(tools: list[dict]) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise P.APIError(400, f"{where}: a tool must be an object", param=where, code="invalid_value")
        if tool.get("type") not in (None, "custom"):
            raise P.APIError(400, f"{where}.type: server tools ({json.dumps(tool.get('type'))}) are not supported by "
                                  "this server; give custom tools (name, description, input_schema)",
                             param=f"{where}.type", code="unsupported_value")
        if not isinstance(tool.get("input_schema"), dict):
            raise P.APIError(400, f"{where}.input_schema: a tool needs its input_schema (a JSON schema object)",
                             param=f"{where}.input_schema", code="invalid_value")
        out.append(function_tool(tool.get("name"), tool.get("description"), tool["input_schema"]))
    return out


def _tool_choice(choice: dict) -> tuple[object, bool]:
    """(chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise P.APIError(400, f"tool_choice.type: must be auto, any, tool or none, got {json.dumps(kind)}",
                         param="tool_choice.type", code="invalid_value")
    return mapped, parallel


def _reasoning(body: MessagesRequest) -> str | None:
    """The chat request's reasoning_effort: "none" for thinking disabled, else output_config's effort."""
    kind = (body.thinking or {}).get("type")
    if body.thinking is not None and kind not in ("enabled", "disabled", "adaptive"):
        raise P.APIError(400, f"thinking.type: must be enabled, disabled or adaptive, got {json.dumps(kind)}",
                         param="thinking.type", code="invalid_value")
    if kind == "disabled":
        return "none"
    effort = (body.output_config or {}).get("effort")
    if effort is None:
        return None
    if effort not in ("low", "medium", "high", "xhigh", "max"):
        raise P.APIError(400, f"output_config.effort: must be low, medium, high, xhigh or max, got "
                              f"{json.dumps(effort)}", param="output_config.effort", code="invalid_value")
    return "xhigh" if effort == "max" else effort


def _format(body: MessagesRequest) -> dict | None:
    fmt = (body.output_config or {}).get("format") or body.output_format
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise P.APIError(400, "output_config.format: must be {\"type\": \"json_schema\", \"schema\": {...}}",
                         param="output_config.format", code="invalid_value")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_request(body: MessagesRequest) -> P.ChatCompletionRequest:
    """The chat completion request of a Messages API body (module docstring). Raises APIError (400)."""
    for name in ("mcp_servers", "container"):
        if getattr(body, name):
            raise P.APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_value")
    if body.messages[-1].role == "assistant":
        raise P.APIError(400, "the last message is the assistant's: continuing a prefilled answer is not supported "
                              "by this server; end with a user message", param=f"messages.{len(body.messages) - 1}",
                         code="unsupported_value")
    system = _system(body.system)
    messages = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(body.messages):
        messages += _chat_messages(m, f"messages.{i}")
    chat: dict = {"model": body.model, "messages": messages, "stream": body.stream}
    if body.tools is not None:
        chat["tools"] = _tools(body.tools)
    if body.tool_choice is not None:
        chat["tool_choice"], chat["parallel_tool_calls"] = _tool_choice(body.tool_choice)
    effort, fmt = _reasoning(body), _format(body)
    if effort is not None:
        chat["reasoning_effort"] = effort
    if fmt is not None:
        chat["response_format"] = fmt
    return chat_body(body, {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                            "top_k": "top_k", "stop_sequences": "stop"}, chat)


# ---- the answer ---------------------------------------------------------------------------------

_STOP_REASONS = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}


def _block(b) -> dict:
    """A finished Block as Anthropic's content block."""
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text, "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": b.text}
    return {"type": "tool_use", "id": b.id, "name": b.name, "input": tool_arguments(b.text)}


def _usage(oc) -> dict:
    return {"input_tokens": oc.prompt_tokens - oc.cached, "output_tokens": oc.completion_tokens,
            "cache_read_input_tokens": oc.cached, "cache_creation_input_tokens": 0}


def _head(model: str) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model}


async def _complete(run) -> Response:
    out = await run.complete()
    if out is None:
        return Response(status_code=CLIENT_GONE)
    blocks = Blocks.of_message(out["choices"][0]["message"])
    oc = outcome(run, blocks)
    return JSONResponse({**_head(run.model), "content": [_block(b) for b in blocks],
                         "stop_reason": _STOP_REASONS[oc.reason], "stop_sequence": oc.stop_sequence,
                         "usage": _usage(oc)})


_START = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}
_DELTA = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
          "call": ("input_json_delta", "partial_json")}


def _block_events(events) -> list[str]:
    out = []
    for ev in events:
        kind, block = ev[0], ev[1]
        if kind == "start":
            start = _START.get(block.kind) or {"type": "tool_use", "id": block.id, "name": block.name, "input": {}}
            out.append(sse("content_block_start", {"type": "content_block_start", "index": block.index,
                                                   "content_block": start}))
        elif kind == "delta":
            name, field = _DELTA[block.kind]
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": block.index,
                                                   "delta": {"type": name, field: ev[2]}}))
        else:
            out.append(sse("content_block_stop", {"type": "content_block_stop", "index": block.index}))
    return out


async def _frames(run):
    """The streamed answer's server-sent events (module docstring)."""
    usage = {"input_tokens": run.prompt_tokens(), "output_tokens": 0, "cache_read_input_tokens": 0,
             "cache_creation_input_tokens": 0}
    yield sse("message_start", {"type": "message_start", "message": {
        **_head(run.model), "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})
    yield sse("ping", {"type": "ping"})
    blocks = Blocks()
    try:
        async for chunk in run.chunks():
            for choice in chunk["choices"]:
                for frame in _block_events(blocks.feed(choice["delta"])):
                    yield frame
        for frame in _block_events(blocks.finish()):
            yield frame
        oc = outcome(run, blocks.blocks)
        yield sse("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": _STOP_REASONS[oc.reason], "stop_sequence": oc.stop_sequence}, "usage": _usage(oc)})
        yield sse("message_stop", {"type": "message_stop"})
    except P.APIError as e:
        yield sse("error", error_body(e))


# ---- routes -------------------------------------------------------------------------------------

def routes(h) -> list[Route]:
    """The Messages API's routes over ``h`` (app._Handlers: its state and start_chat)."""

    @renaming(_NAMES)
    async def messages(request: Request):
        body = await _body(request, h.state, MessagesRequest)
        if body.max_tokens is None:
            raise P.APIError(400, "max_tokens: Field required", param="max_tokens", code="invalid_value")
        run = await h.start_chat(request, chat_request(body))
        return event_stream(_frames(run), run) if body.stream else await _complete(run)

    @renaming(_NAMES)
    async def count_tokens(request: Request):
        """{"input_tokens": the prompt's tokens as /v1/messages renders it}: its usage's
        input_tokens plus cache_read_input_tokens."""
        body = await _body(request, h.state, MessagesRequest)
        chat = chat_request(body)
        slot = await h.state.acquire(chat.model, chat.keep_alive_seconds(), check=has_chat_template)
        try:
            _, tools, _ = chat.tool_setup()
            return JSONResponse({"input_tokens": len(await h.chat_prompt(slot, chat, tools))})
        finally:
            h.state.pool.release(slot)

    return [Route(PREFIX, messages, methods=["POST"]),
            Route(f"{PREFIX}/count_tokens", count_tokens, methods=["POST"])]
