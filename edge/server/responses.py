"""OpenAI's Responses API on `edge serve` (what Codex CLI speaks): POST /v1/responses, stateless.

Formats: OpenAI's API reference (Responses: create, the response object, streaming events) and
the types of the openai Python package (openai.types.responses: Response, ResponseStreamEvent
...). A request is translated into a chat completion (edge.server.app._Handlers.start_chat)
and the answer back:

- ``input``: a string (one user message) or items: messages (role user, assistant, system,
  developer; content a string or input_text / output_text parts), ``function_call`` items
  (joined to the assistant turn before them as its tool calls) and ``function_call_output``
  items (``role: "tool"`` messages); ``reasoning`` items given back are dropped (the chat
  templates drop past reasoning too). Images, files, audio and other item types: 400.
  ``instructions`` is the system message.
- ``max_output_tokens``, ``temperature``, ``top_p``; ``tools`` (``type: "function"`` with name,
  description, parameters at the top level; built-in tools such as web_search: 400),
  ``tool_choice`` (auto, none, required, {type: function, name}), ``parallel_tool_calls``;
  ``text.format`` json_schema ({name, schema, strict}) or json_object constrains the answer
  (edge.grammar); ``reasoning.effort`` (none turns a reasoning model's thinking off; the others
  reach the chat template). ``store`` is accepted but nothing is stored (the answer says
  ``store: false``), so ``previous_response_id`` and ``conversation`` are a 400; so are
  ``background``, ``prompt``, ``truncation: "auto"``, ``top_logprobs`` above 0,
  ``max_tool_calls`` and a ``text.verbosity`` other than medium. ``include``, ``metadata``,
  ``user``, ``prompt_cache_key``, ``service_tier``, ``reasoning.summary`` change nothing.
- The answer: a ``response`` object whose ``output`` holds a ``reasoning`` item (its text as a
  reasoning_text content part; no summary), a ``message`` item (one output_text part) and a
  ``function_call`` item per call (``call_id`` to answer with function_call_output; arguments
  as JSON text); status ``completed``, or ``incomplete`` with incomplete_details.reason
  ``max_output_tokens`` when the token limit or the context cut it. usage: input_tokens (with
  input_tokens_details.cached_tokens read from the prefix cache), output_tokens (with
  output_tokens_details.reasoning_tokens: the reasoning text's tokens), total_tokens.
- Streamed: server-sent events named by their ``type``, each with ``sequence_number``:
  response.created, response.in_progress, per item response.output_item.added, for text
  response.content_part.added / response.output_text.delta / response.output_text.done /
  response.content_part.done (reasoning: response.reasoning_text.delta / .done), for a call
  response.function_call_arguments.delta / .done (the arguments arrive in one delta when the
  call closes), response.output_item.done, then response.completed (or response.incomplete)
  with the whole response. A failure mid-stream is response.failed (error.code server_error).
- Errors before the answer are OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge.server import protocol as P
from edge.server.adapter import Blocks, chat_body, event_stream, function_tool, outcome, renaming, sse
from edge.server.app import CLIENT_GONE, _body

_NAMES = [(r"tools\.(\d+)\.function\.", r"tools.\1."), (r"response_format", "text.format"),
          (r"max_tokens", "max_output_tokens"), (r"reasoning_effort", "reasoning.effort")]
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ResponsesRequest(P._Body):
    """A POST /v1/responses body; fields not listed are ignored."""

    model: str
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: Annotated[P.Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[P.Number, Field(ge=0, le=1)] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    reasoning: dict | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: dict | None = None
    background: bool | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


def _refuse(param: str, why: str) -> P.APIError:
    return P.APIError(400, f"{param}: {why}", param=param, code="unsupported_value")


def _check(body: ResponsesRequest) -> None:
    """Raise APIError (400) for what this stateless server does not do (module docstring)."""
    if body.previous_response_id is not None:
        raise _refuse("previous_response_id", "this server is stateless and stores no response; send the whole "
                                              "conversation in input (with store: false)")
    if body.conversation is not None:
        raise _refuse("conversation", "this server is stateless; send the whole conversation in input")
    if body.prompt is not None:
        raise _refuse("prompt", "stored prompt templates are not supported; send instructions and input")
    if body.background:
        raise _refuse("background", "background responses are not supported")
    if body.truncation not in (None, "disabled"):
        raise _refuse("truncation", "only \"disabled\" is supported (a prompt longer than the context is a 400)")
    if body.top_logprobs:
        raise _refuse("top_logprobs", "logprobs are not supported on /v1/responses (use /v1/chat/completions)")
    if body.max_tool_calls is not None:
        raise _refuse("max_tool_calls", "not supported; leave it out")
    verbosity = (body.text or {}).get("verbosity")
    if verbosity not in (None, "medium"):
        raise _refuse("text.verbosity", "only \"medium\" is supported")


def _text(content, where: str) -> str:
    """A message's or an output's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.APIError(400, f"{where}: must be a string or a list of content parts", param=where,
                         code="invalid_value")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise P.APIError(400, f"{where}.{j}: content parts of type {json.dumps(kind)} are not supported by this "
                                  "server (input_text and output_text only)", param=f"{where}.{j}",
                             code="unsupported_content")
    return "".join(out)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise P.APIError(400, f"{where}.{key}: must be a string", param=f"{where}.{key}", code="invalid_value")
    return value


def _chat_messages(body: ResponsesRequest) -> list[dict]:
    """The chat messages of instructions and input (module docstring)."""
    out = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise P.APIError(400, f"{where}.role: must be user, assistant, system or developer, got "
                                      f"{json.dumps(role)}", param=f"{where}.role", code="invalid_value")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":     # the same turn: its text, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise P.APIError(400, f"{where}.type: input items of type {json.dumps(kind)} are not supported by this "
                                  "server (message, function_call, function_call_output, reasoning)",
                             param=f"{where}.type", code="unsupported_value")
    if not out:
        raise P.APIError(400, "input: give at least one message", param="input", code="invalid_value")
    return out


def _tools(tools: list[dict]) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise P.APIError(400, f"{where}.type: tools of type {json.dumps(kind)} are not supported by this server "
                                  "(function tools only)", param=f"{where}.type", code="unsupported_value")
        out.append(function_tool(tool.get("name"), tool.get("description"), tool.get("parameters")))
    return out


def _tool_choice(choice):
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise P.APIError(400, "tool_choice: must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                          "\"name\": ...}", param="tool_choice", code="invalid_value")


def _format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise P.APIError(400, "text.format: must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                          "\"json_schema\", \"name\": ..., \"schema\": {...}}", param="text.format",
                     code="invalid_value")


def chat_request(body: ResponsesRequest) -> P.ChatCompletionRequest:
    """The chat completion request of a Responses API body (module docstring). Raises APIError (400)."""
    _check(body)
    chat: dict = {"model": body.model, "messages": _chat_messages(body), "stream": body.stream}
    if body.tools is not None:
        chat["tools"] = _tools(body.tools)
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = _format(body.text)
    if fmt is not None:
        chat["response_format"] = fmt
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise P.APIError(400, f"reasoning.effort: must be one of {', '.join(_EFFORTS)}, got {json.dumps(effort)}",
                             param="reasoning.effort", code="invalid_value")
        chat["reasoning_effort"] = effort
    return chat_body(body, {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                            "parallel_tool_calls": "parallel_tool_calls"}, chat)


# ---- the answer ---------------------------------------------------------------------------------

class _Answer:
    """One response's ids and fields: the response object around ``output`` and each block's item."""

    def __init__(self, body: ResponsesRequest, run):
        self.body, self.run = body, run
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.item_ids: dict[int, str] = {}

    def item_id(self, block) -> str:
        prefix = {"reasoning": "rs", "text": "msg", "call": "fc"}[block.kind]
        return self.item_ids.setdefault(block.index, f"{prefix}_{uuid.uuid4().hex}")

    def item(self, block, status: str, whole: bool = True) -> dict:
        """``block``'s output item with ``status``; without ``whole``, as it is added (no content yet)."""
        iid = self.item_id(block)
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": iid, "summary": [], "status": status,
                    "content": [self.part(block)] if whole else []}
        if block.kind == "text":
            return {"type": "message", "id": iid, "status": status, "role": "assistant",
                    "content": [self.part(block)] if whole else []}
        return {"type": "function_call", "id": iid, "call_id": block.id, "name": block.name,
                "arguments": block.text if whole else "", "status": status}

    @staticmethod
    def part(block, text: str | None = None) -> dict:
        text = block.text if text is None else text
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def usage(self, oc, blocks) -> dict:
        reasoning = "".join(b.text for b in blocks if b.kind == "reasoning")
        n_reasoning = len(self.run.engine.tokenizer.encode(reasoning, False, False)) if reasoning else 0
        return {"input_tokens": oc.prompt_tokens,
                "input_tokens_details": {"cached_tokens": oc.cached, "cache_write_tokens": 0},
                "output_tokens": oc.completion_tokens, "output_tokens_details": {"reasoning_tokens": n_reasoning},
                "total_tokens": oc.prompt_tokens + oc.completion_tokens}

    def response(self, status: str, output: list, usage=None, error=None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.run.model,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": None,
                "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": None},
                "store": False, "temperature": b.temperature,
                "text": {"format": (b.text or {}).get("format") or {"type": "text"}},
                "tool_choice": b.tool_choice or "auto", "tools": b.tools or [], "top_p": b.top_p,
                "truncation": "disabled", "usage": usage, "user": None, "metadata": b.metadata or {}}


def _status(oc) -> str:
    return "incomplete" if oc.reason == "length" else "completed"


async def _complete(answer: _Answer) -> Response:
    run = answer.run
    out = await run.complete()
    if out is None:
        return Response(status_code=CLIENT_GONE)
    blocks = Blocks.of_message(out["choices"][0]["message"])
    oc = outcome(run, blocks)
    status = _status(oc)
    output = [answer.item(b, status if b is blocks[-1] else "completed") for b in blocks]
    return JSONResponse(answer.response(status, output, answer.usage(oc, blocks)))


class _Events:
    """The streamed answer's events, numbered (sequence_number) as they are made."""

    def __init__(self, answer: _Answer):
        self.answer, self.n = answer, 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return sse(kind, data)

    def of(self, events, final_status: str = "completed") -> list[str]:
        """The events of Blocks events; ``final_status``: the status of the items they stop (at
        the finish, the last block's: incomplete when the token limit cut it)."""
        a, out = self.answer, []
        for ev in events:
            kind, block = ev[0], ev[1]
            at = {"item_id": a.item_id(block), "output_index": block.index}
            content = "reasoning_text" if block.kind == "reasoning" else "output_text"
            if kind == "start":
                out.append(self("response.output_item.added", output_index=block.index,
                                item=a.item(block, "in_progress", whole=False)))
                if block.kind != "call":
                    out.append(self("response.content_part.added", **at, content_index=0, part=a.part(block, "")))
            elif kind == "delta" and block.kind == "call":
                out.append(self("response.function_call_arguments.delta", **at, delta=ev[2]))
            elif kind == "delta":
                extra = {"logprobs": []} if block.kind == "text" else {}
                out.append(self(f"response.{content}.delta", **at, content_index=0, delta=ev[2], **extra))
            else:
                if block.kind == "call":
                    out.append(self("response.function_call_arguments.done", **at, name=block.name,
                                    arguments=block.text))
                else:
                    extra = {"logprobs": []} if block.kind == "text" else {}
                    out.append(self(f"response.{content}.done", **at, content_index=0, text=block.text, **extra))
                    out.append(self("response.content_part.done", **at, content_index=0, part=a.part(block)))
                out.append(self("response.output_item.done", output_index=block.index, item=a.item(block, final_status)))
        return out


async def _frames(answer: _Answer):
    run, emit = answer.run, _Events(answer)
    yield emit("response.created", response=answer.response("in_progress", []))
    yield emit("response.in_progress", response=answer.response("in_progress", []))
    blocks = Blocks()
    try:
        async for chunk in run.chunks():
            for choice in chunk["choices"]:
                for frame in emit.of(blocks.feed(choice["delta"])):
                    yield frame
        oc = outcome(run, blocks.blocks)
        status = _status(oc)
        for frame in emit.of(blocks.finish(), status):
            yield frame
        output = [answer.item(b, status if b is blocks.blocks[-1] else "completed") for b in blocks.blocks]
        yield emit(f"response.{status}", response=answer.response(status, output, answer.usage(oc, blocks.blocks)))
    except P.APIError as e:
        output = [answer.item(b, "incomplete") for b in blocks.blocks]
        yield emit("response.failed", response=answer.response(
            "failed", output, error={"code": "server_error", "message": e.message}))


def routes(h) -> list[Route]:
    """The Responses API's route over ``h`` (app._Handlers: its state and start_chat)."""

    @renaming(_NAMES)
    async def create(request: Request):
        body = await _body(request, h.state, ResponsesRequest)
        run = await h.start_chat(request, chat_request(body))
        answer = _Answer(body, run)
        return event_stream(_frames(answer), run) if body.stream else await _complete(answer)

    return [Route("/v1/responses", create, methods=["POST"])]
