"""What the adapters of other APIs over the chat path share (edge.server.anthropic: Anthropic's
Messages API; edge.server.responses: OpenAI's Responses API).

Both build a P.ChatCompletionRequest from their own body, submit it with
``_Handlers.start_chat`` and translate the ChatRun's OpenAI dicts back. Their answers are a
list of typed blocks where Chat Completions has one message: reasoning, then text, then tool
calls. :class:`Blocks` turns chat.completion.chunk deltas (or a whole chat.completion message)
into that list, as start / delta / stop events of :class:`Block`; :func:`outcome` reads the
end of a run; :func:`sse` frames a server-sent event with its ``event:`` name (both APIs
name their events); :func:`chat_body` validates the translated request; :func:`renaming` makes
a route's errors name the adapter's fields instead of the chat request's.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.responses import StreamingResponse

from edge.server import protocol as P


@dataclass
class Block:
    """One block of an answer. kind: "reasoning", "text" or "call" (a tool call: ``id``,
    ``name``; its ``text`` is the arguments' JSON text). ``index``: its place in the answer."""

    kind: str
    index: int
    text: str = ""
    id: str | None = None
    name: str | None = None


class Blocks:
    """Chat deltas -> blocks. ``feed(delta)`` returns events ``("start", block)``,
    ``("delta", block, text)``, ``("stop", block)`` in the answer's order: a block starts when
    its kind changes (or a new call starts) and stops when the next starts or at ``finish()``,
    which also gives an empty text block to an answer that had none at all (so every answer
    has a block to read). ``blocks`` lists them all."""

    def __init__(self):
        self.blocks: list[Block] = []
        self.open: Block | None = None

    @classmethod
    def of_message(cls, message: dict) -> list[Block]:
        """The blocks of a whole chat.completion ``message``."""
        b = cls()
        b.feed(message)
        b.finish()
        return b.blocks

    def feed(self, delta: dict) -> list[tuple]:
        out: list[tuple] = []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id") is not None:
                out += self._start("call", id=call["id"], name=fn.get("name"))
            if fn.get("arguments"):
                out += self._append(fn["arguments"])
        return out

    def finish(self) -> list[tuple]:
        out = self._start("text") if not self.blocks else []
        out += self._stop()
        return out

    def _text(self, kind: str, text: str) -> list[tuple]:
        out = self._start(kind) if self.open is None or self.open.kind != kind else []
        return out + self._append(text)

    def _append(self, text: str) -> list[tuple]:
        self.open.text += text
        return [("delta", self.open, text)]

    def _start(self, kind: str, **kw) -> list[tuple]:
        out = self._stop()
        self.open = Block(kind, len(self.blocks), **kw)
        self.blocks.append(self.open)
        return out + [("start", self.open)]

    def _stop(self) -> list[tuple]:
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [("stop", block)]


@dataclass
class Outcome:
    """How a run ended: ``reason`` "stop" (end of turn), "stop_sequence", "length" (the token
    limit or the context) or "tool_calls"; ``stop_sequence``: the stop string that ended it;
    token counts as OpenAI's usage (``cached``: prompt tokens read from the prefix cache)."""

    reason: str
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    cached: int


def outcome(run, blocks: list[Block]) -> Outcome:
    """The Outcome of an ended ChatRun whose answer is ``blocks`` (a call among them: "tool_calls",
    as ChatRun's finish_reason; a stop string the scheduler matched: "stop_sequence")."""
    fin = run.timing()
    reason = fin.finish_reason
    if any(b.kind == "call" for b in blocks):
        reason = "tool_calls"
    elif reason == "stop" and fin.stop_sequence is not None:
        reason = "stop_sequence"
    return Outcome(reason, fin.stop_sequence if reason == "stop_sequence" else None, fin.prompt_tokens,
                   fin.completion_tokens, fin.cached_tokens)


def tool_arguments(text: str) -> dict:
    """A call's arguments JSON text as an object (the ToolCallParser gives only objects)."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise P.APIError(500, "a tool call's arguments are not a JSON object", code="internal_error")
    return value


def function_tool(name, description, schema) -> dict:
    """An OpenAI chat ``tools`` entry from a flat tool definition (Anthropic's name /
    description / input_schema, the Responses API's name / description / parameters); the
    chat side (edge.tool_calls.check_tools) checks the values."""
    fn = {"name": name}
    if description is not None:
        fn["description"] = description
    if schema is not None:
        fn["parameters"] = schema
    return {"type": "function", "function": fn}


def sse(event: str, data: dict) -> str:
    """One server-sent event with its name, as Anthropic's and the Responses API's streams are
    framed: ``event: NAME`` and ``data: JSON`` lines, then a blank line."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_stream(frames, run) -> StreamingResponse:
    """A text/event-stream response of the strings ``frames`` (an async iterator) yields; the
    run is cancelled when the stream ends early (the client went away)."""
    async def body():
        try:
            async for frame in frames:
                yield frame
        finally:
            run.cancel()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def rename(err: P.APIError, names: list[tuple[str, str]]) -> P.APIError:
    """``err`` with the chat request's field names in its param and message replaced by the
    adapter's (``names``: (regex on a dotted path, replacement), first match wins; e.g.
    ``tools.0.function.parameters`` -> ``tools.0.input_schema``)."""
    if not err.param:
        return err
    for pattern, repl in names:
        new, n = re.subn(rf"^{pattern}", repl, err.param)
        if n:
            if err.message.startswith(err.param):
                err.message = new + err.message[len(err.param):]
            err.param = new
            break
    return err


def chat_body(body, fields: dict[str, str], chat: dict) -> P.ChatCompletionRequest:
    """The chat request ``chat`` (fields already translated) with ``body``'s fields named in
    ``fields`` (the adapter's name -> the chat request's) that are given, validated. Raises
    APIError (400) naming the chat request's field (``renaming`` puts it back)."""
    for ours, theirs in fields.items():
        value = getattr(body, ours)
        if value is not None:
            chat[theirs] = value
    try:
        return P.ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        raise P.validation_error(e) from None


def renaming(names: list[tuple[str, str]]):
    """Decorator of a route handler: its APIErrors get ``names`` (rename), so they name the
    fields the client sent."""
    def wrap(handler):
        @functools.wraps(handler)
        async def route(request):
            try:
                return await handler(request)
            except P.APIError as e:
                raise rename(e, names) from None
        return route
    return wrap
