"""Tool calls (OpenAI's function calling): check ``tools``, find calls in a model's output,
and build the grammar that forces one for tool_choice "required" or a named function.

Formats, chosen from the text of the model's chat template (:func:`detect_format`):

- ``hermes`` (Qwen2.5, Qwen3, Hermes 2/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number, text around them is content (the prompt format the Qwen2.5 template describes);
  small models often leave the tags out, so an answer that is wholly such a JSON object (or
  ``generic``'s shapes), bare or in a Markdown code fence (no language or json), naming one of
  the tools, is a call too, and so are such objects one after another.
- ``llama3`` (Llama 3.1-3.3): the whole answer is one JSON object ``{"name": ...,
  "parameters": {...}}`` (or "arguments"), possibly after ``<|python_tag|>`` (which may follow
  some text: that is content); several are separated by ``;`` (Meta's llama-models
  prompt-format documentation).
- ``mistral``: ``[TOOL_CALLS]`` (after some content or none) then a JSON array of ``{"name",
  "arguments"}`` objects (Mistral's tokenizer documentation, v3 tool-call format); the tag is a
  control token, which the text of an answer may not show, so the array alone is taken too.
  ``<|python_tag|>`` (llama3) likewise.
- ``generic`` (any other template): the Hermes tags, or an answer that is wholly a JSON object
  ``{"name", "arguments"}`` / ``{"tool_call": {...}}`` / ``{"tool_calls": [...]}``.

:class:`ToolCallParser` reads the output as it streams: text that may still become a call
(a prefix of ``<tool_call>``; an answer starting with ``{`` or a code fence, until it cannot be
a call: another fence language, a first key no call has, a name not among the tools') is held
back until it is known, so no part of a tag reaches the content. A call's text that is not
valid JSON with a string name stays content.
"""
from __future__ import annotations

import functools
import json
import re
import secrets
import uuid
import weakref
from dataclasses import dataclass, field

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
FORMATS = ("hermes", "llama3", "mistral", "generic")
_FENCE = re.compile(r"^```(?:json|JSON)?\n(.*)\n```$", re.S)     # a call's fence: no info string or json
_CALL_KEYS = ("name", "arguments", "parameters", "tool_call", "tool_calls", "function")
_KEY = re.compile(r'"((?:[^"\\]|\\.)*)("?)')
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")      # OpenAI: a-z, A-Z, 0-9, _ and -, at most 64


class ToolError(ValueError):
    """A ``tools`` / ``tool_choice`` value that is not valid; ``param`` is the field's path."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolCall:
    """One parsed call: ``name`` and ``arguments`` (the JSON text of an object), with its ``id``."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        """The call as OpenAI's ``message.tool_calls[i]``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def mistral_id() -> str:
    """A tool-call id as Mistral's chat templates require it: 9 random letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def detect_format(template_source: str | None) -> str:
    """The tool-call format of a chat template's text: one of FORMATS."""
    src = template_source or ""
    if HERMES_OPEN in src:
        return "hermes"
    if MISTRAL_TAG in src:
        return "mistral"
    if PYTHON_TAG in src or ("<|start_header_id|>" in src and '"parameters"' in src):
        return "llama3"
    return "generic"


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "d", "parameters": NO_PARAMETERS}}
_renders_tools: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def template_renders_tools(template) -> bool:
    """True when the chat template (edge.chat_template.ChatTemplate) writes a ``tools`` variable
    into the prompt: a one-message chat renders differently with a tool than without (a
    template whose probe fails counts as writing them). Cached per template."""
    from edge.chat_template import ChatTemplateError

    if template not in _renders_tools:
        chat = [{"role": "user", "content": "hi"}]
        try:
            _renders_tools[template] = template.render(chat, tools=[_PROBE_TOOL]) != template.render(chat)
        except ChatTemplateError:
            _renders_tools[template] = True
    return _renders_tools[template]


def check_tools(tools) -> list[dict]:
    """``tools`` checked as OpenAI's function tools: ``[{"type": "function", "function": {"name",
    "description"?, "parameters"?, "strict"?}}]``; returns them with ``parameters`` defaulted to
    NO_PARAMETERS (a function without parameters takes ``{}``). ``parameters`` must be a JSON
    schema of type "object" that llguidance compiles (checked here, whatever tool_choice is).

    Raises:
        ToolError: naming the first bad entry (param ``tools.<i>...``).
    """
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"{where}: a tool must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function: must be an object with a name", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"{where}.function.name: must be 1-64 letters, digits, '_', '-' or '.', got "
                            f"{json.dumps(name)[:70]}", f"{where}.function.name")
        if name in names:
            raise ToolError(f"{where}.function.name: {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise ToolError(f"{where}.function.description: must be a string", f"{where}.function.description")
        params = fn.get("parameters")
        params = dict(NO_PARAMETERS) if params is None else params
        _check_parameters(params, f"{where}.function.parameters")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def _check_parameters(params, param: str) -> None:
    """Raise ToolError (``param``) unless ``params`` is an object schema llguidance compiles."""
    if not isinstance(params, dict):
        raise ToolError(f"{param}: must be a JSON schema object", param)
    if params.get("type", "object") != "object":
        raise ToolError(f"{param}: must be a JSON schema of type \"object\", got type "
                        f"{json.dumps(params['type'])[:40]}", param)
    error = _compile_error(json.dumps(params, sort_keys=True))
    if error:
        raise ToolError(f"{param}: {error}", param)


@functools.lru_cache(maxsize=512)
def _compile_error(params_json: str) -> str | None:
    """llguidance's message for a parameters schema (JSON text) it cannot compile as the call
    grammars use it (objects closed by edge.grammar.prepare), or None."""
    from edge.grammar import GrammarError, json_schema

    try:
        json_schema(json.loads(params_json))
    except GrammarError as e:
        return str(e)
    return None


def chosen_tools(tools: list[dict], tool_choice) -> tuple[str, list[dict]]:
    """(mode, the tools a call may use) for ``tool_choice``: mode "auto", "none", "required"
    (a named function is "required" with that one tool). Raises ToolError for another value or
    a name not among ``tools``."""
    if tool_choice is None:
        return ("auto" if tools else "none"), tools
    if tool_choice in ("auto", "none", "required"):
        if tool_choice == "required" and not tools:
            raise ToolError("tool_choice: \"required\" needs tools", "tool_choice")
        return tool_choice, tools
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise ToolError(f"tool_choice: function {json.dumps(name)[:70]} is not one of the tools", "tool_choice")
        return "required", named
    raise ToolError("tool_choice: must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                    "\"function\": {\"name\": ...}}", "tool_choice")


def _body_rules(tools: list[dict], fmt: str) -> str:
    """Lark rules of ``body``, one call's JSON object naming one of ``tools``: ``{"name": "<name>",
    "arguments": `` (llama3: "parameters") written out, then the tool's ``parameters`` (closed)
    as its own ``%json`` rule, so each schema keeps its root ("#/$defs/..." refs resolve), laid
    out as edge.grammar.JSON_LAYOUT."""
    from edge.grammar import prepare

    key = "parameters" if fmt == "llama3" else "arguments"
    alts, rules = [], []
    for i, tool in enumerate(tools):
        head = json.dumps(f'{{"name": "{tool["function"]["name"]}", "{key}": ')
        alts.append(f'{head} args{i} "}}"')
        rules.append(f"args{i}: %json {json.dumps(prepare(tool['function']['parameters']))}\n")
    return "body: " + " | ".join(alts) + "\n" + "".join(rules)


def call_grammar(tools: list[dict], fmt: str, parallel: bool):
    """The edge.grammar.Grammar (Lark, with llguidance's %json) of answers that are only tool
    calls in format ``fmt``: at least one (exactly one unless ``parallel``), each naming one of
    ``tools`` with arguments valid against its ``parameters`` (:func:`_body_rules`).

    Raises:
        edge.grammar.GrammarError: llguidance refuses a schema.
    """
    from edge.grammar import lark

    body = _body_rules(tools, fmt)
    if fmt == "mistral":
        rest = ' (", " body)*' if parallel else ""
        return lark(f'start: "{MISTRAL_TAG}[" body{rest} "]"\n{body}')
    if fmt == "llama3":
        rest = ' (";" body)*' if parallel else ""
        return lark(f'start: body{rest}\n{body}')
    rest = ' ("\\n" call)*' if parallel else ""
    return lark(f'start: call{rest}\ncall: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"\n{body}')


def lazy_call_grammar(tools: list[dict], fmt: str, parallel: bool):
    """(trigger, grammar of the text after it) for tool_choice "auto" (edge.grammar.LazyGrammarMask):
    the answer is free until a call opens, then the call (and, with ``parallel``, more calls)
    must name one of ``tools`` with valid arguments, and nothing follows the calls. None for the
    formats without an opening tag (llama3 and generic: a call there is the whole answer, and
    text cannot be told from its start).

    Raises:
        edge.grammar.GrammarError: as call_grammar.
    """
    from edge.grammar import lark

    body = _body_rules(tools, fmt)
    if fmt == "mistral":
        rest = ' (", " body)*' if parallel else ""
        return MISTRAL_TAG, lark(f'start: "[" body{rest} "]"\n{body}')
    if fmt != "hermes":
        return None
    rest = ' ("\\n" call)*' if parallel else ""
    return HERMES_OPEN, lark(f'start: first{rest}\nfirst: "\\n" body "\\n{HERMES_CLOSE}"\n'
                             f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"\n{body}')


def _call(obj, keys=("arguments", "parameters")) -> ToolCall | None:
    """A ToolCall from a parsed ``{"name": str, "arguments" | "parameters": object | JSON text}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(text: str, fmt: str, names: set[str] | None = None) -> list[ToolCall] | None:
    """The calls of a whole-answer JSON format (llama3, mistral, generic; a Markdown code fence
    around it is taken off; hermes and generic take several call objects separated by
    whitespace too), or None when ``text`` is not one or names a function not in ``names``
    (None: any)."""
    text = text.strip()
    fence = _FENCE.match(text)
    if fence:
        text = fence.group(1).strip()
    if fmt == "mistral":
        text = text[len(MISTRAL_TAG):] if text.startswith(MISTRAL_TAG) else text
    elif text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):]
    if not text:
        return None
    try:
        if fmt == "llama3":
            values = [json.loads(part) for part in _split_top_level(text, ";")]
        elif fmt == "mistral":
            values = [json.loads(text)]
        else:                # one value, or call objects one after another (small models write them so)
            values = _json_values(text)
    except ValueError:
        return None
    if fmt == "mistral":
        if not isinstance(values[0], list):
            return None
        values = values[0]
    elif fmt in ("hermes", "generic") and len(values) == 1 and isinstance(values[0], dict):
        v = values[0]
        values = [v["tool_call"]] if "tool_call" in v else v["tool_calls"] if isinstance(v.get("tool_calls"), list) \
            else values
    calls = [_call(v) for v in values]
    if not calls or not all(calls) or (names is not None and any(c.name not in names for c in calls)):
        return None
    return calls


def _json_values(text: str) -> list:
    """The JSON values of ``text``, one after another with whitespace between them. Raises
    ValueError when it is not that."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        value, pos = decoder.raw_decode(text, pos)
        values.append(value)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return values


def _json_scan(text: str):
    """Yield (index, char, depth, in_str) after each character of ``text``: the JSON objects and
    arrays open, and whether it is inside a string."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc, in_str = (not esc and ch == "\\"), in_str and (esc or ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        yield i, ch, depth, in_str


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside JSON strings, objects and arrays."""
    parts, start = [], 0
    for i, ch, depth, in_str in _json_scan(text):
        if ch == sep and depth == 0 and not in_str:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


class ToolCallParser:
    """Splits a streamed answer into content and tool calls.

    ``feed(text)`` and ``finish()`` return events: ``("content", str)`` or ``("call", ToolCall)``,
    in the answer's order. ``parallel=False`` keeps the first call only (what follows it is
    dropped). ``names``: the tools' names; a call (tagged or not) must use one of them, else its
    text stays content (a JSON answer the user asked for is not a call). ``forced``: the answer
    is only calls (tool_choice "required": a grammar forced them), so no text of it is content.
    ``calls`` lists the calls emitted so far.

    An answer cut short (max_tokens, a stop string) keeps its complete calls; a call it cut
    (an open ``<tool_call>`` followed by nothing or by JSON that does not parse, a tag's prefix
    after a call, a tagged whole-answer format that does not parse) is dropped, not content;
    a close tag cut short still closes a call whose JSON is whole.
    """

    def __init__(self, fmt: str = "hermes", parallel: bool = True, names=None, forced: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r} (one of {', '.join(FORMATS)})")
        self.fmt, self.parallel, self.forced = fmt, parallel, forced
        self.names = set(names) if names is not None else None
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_call = False        # inside <tool_call> ... </tool_call>
        self._space = ""             # whitespace before the open tag: content again if no call follows
        self._whole = False          # the answer is a JSON format's: held until finish()
        self._started = False        # some non-space text was seen
        self._done = False           # parallel=False and the call is taken: the rest is dropped
        self._after_call = False     # the last event was a call: leading whitespace is dropped

    def feed(self, text: str) -> list[tuple[str, object]]:
        """Events for the next piece of the answer (text that may still be a call is held)."""
        if self._done or not text:
            return []
        self._buf += text
        if not self._started or self._whole:
            lead = self._buf.lstrip()
            if not lead:
                return []
            if self._may_start_json(lead):
                if len(lead) < len(PYTHON_TAG) and PYTHON_TAG.startswith(lead) or \
                        len(lead) < len(MISTRAL_TAG) and MISTRAL_TAG.startswith(lead):
                    return []                     # a tag's prefix: wait for more
                self._whole = True
            else:
                self._started = True
        if not self._whole:
            return self._scan(final=False)
        if not self._not_a_call():
            return []
        self._whole, self._started = False, True      # decided: text, streamed from here
        out, lead = [], self._buf.lstrip()
        tag = next((t for t in (PYTHON_TAG, MISTRAL_TAG) if lead.startswith(t)), None)
        if tag is not None and self.fmt in ("llama3", "mistral"):     # the tag is text: scan on after it
            cut = len(self._buf) - len(lead) + len(tag)
            out = self._content(self._space + self._buf[:cut])
            self._buf, self._space = self._buf[cut:], ""
        return _merge(out + self._scan(final=False))

    def finish(self) -> list[tuple[str, object]]:
        """Events for whatever is held at the end of the answer."""
        if self._done:
            return []
        if self._whole:
            calls = _json_calls(self._buf, self.fmt, self.names)
            if calls:
                self._buf = ""
                return self._take(calls)
            lead = self._buf.lstrip()
            tag = next((t for t in (PYTHON_TAG, MISTRAL_TAG) if lead.startswith(t)), None)
            if tag is not None and _unclosed(lead[len(tag):]):
                self._buf = ""                # a tagged call cut short: no content
                return []
            self._buf, self._space = self._space + self._buf, ""
        self._started, self._whole = True, False     # not a call: the text as it is
        return self._scan(final=True)

    def _not_a_call(self) -> bool:
        """True once the held whole-answer text cannot become a call (a fence with another info
        string than json, JSON that is not an object of a call's keys, a name not among the
        tools'), so it streams instead of waiting for the end of the answer."""
        text = self._buf.lstrip()
        if len(text) < 3 and "```".startswith(text):
            return False
        if text.startswith("```"):
            line, nl, rest = text[3:].partition("\n")
            if line.strip().lower() not in ("", "json") and (nl or not "json".startswith(line.lower())):
                return True
            if not nl:
                return False
            text = rest.lstrip()
        for tag in (PYTHON_TAG, MISTRAL_TAG):
            if text.startswith(tag):
                text = text[len(tag):].lstrip()
        if self.fmt == "mistral" and text.startswith("["):
            text = text[1:].lstrip()
        if not text:
            return False
        if text[0] != "{":
            return True
        text = text[1:].lstrip()
        key = _KEY.match(text)
        if not text or key is None:
            return bool(text)
        if not key.group(2):
            return not any(k.startswith(key.group(1)) for k in _CALL_KEYS)
        if key.group(1) not in _CALL_KEYS:
            return True
        if key.group(1) != "name" or self.names is None:
            return False
        after = text[key.end():]
        colon = re.match(r"\s*:\s*", after)
        if colon is None:
            return bool(after.strip())
        rest = after[colon.end():]
        if not rest:
            return False
        value = _KEY.match(rest)
        if value is None:
            return True                   # a name that is no string
        name = value.group(1)
        return name not in self.names if value.group(2) else not any(n.startswith(name) for n in self.names)

    def _may_start_json(self, lead: str) -> bool:
        if self.fmt == "mistral":     # the tag is a control token: the text may lack it
            return lead.startswith(("[", MISTRAL_TAG))
        if self.fmt in ("hermes", "generic"):
            return lead.startswith(("{", "```")) or "```".startswith(lead)
        return lead.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(lead)

    def _take(self, calls: list[ToolCall]) -> list[tuple[str, object]]:
        if self.fmt == "mistral":     # Mistral's templates refuse other ids (llama.cpp makes the same)
            for call in calls:
                call.id = mistral_id()
        if not self.parallel:
            calls = calls[:1]
            self._done = True
        self.calls += calls
        return [("call", c) for c in calls]

    def _scan(self, final: bool) -> list[tuple[str, object]]:
        """Hermes tags through the buffer (every format accepts them except the JSON-only ones)."""
        out: list[tuple[str, object]] = []
        tags = self.fmt in ("hermes", "generic")
        if not tags and not final:    # llama3 / mistral: a call's tag after some text starts the call
            tag = PYTHON_TAG if self.fmt == "llama3" else MISTRAL_TAG
            j = self._buf.find(tag)
            if j >= 0:
                text = self._buf[:j]
                self._space = text[len(text.rstrip()):]     # content again if no call follows
                out += self._content(text.rstrip())
                self._buf, self._whole = self._buf[j:], True
                return out
            keep = _partial_suffix(self._buf, tag)
            keep = len(self._buf) - len(self._buf[:len(self._buf) - keep].rstrip())
            out += self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return out
        while self._buf and not self._done:
            if not self._in_call:
                j = self._buf.find(HERMES_OPEN) if tags else -1
                if j < 0:
                    keep = 0 if final or not tags else _partial_suffix(self._buf, HERMES_OPEN)
                    if not final:      # whitespace before a call or at the end is no content
                        keep = len(self._buf) - len(self._buf[:len(self._buf) - keep].rstrip())
                    text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    if final and self.calls:
                        text = text.rstrip()
                        if tags and self._after_call and HERMES_OPEN.startswith(text.strip()):
                            text = ""      # the next call's tag, cut short
                    out += self._content(text)
                    break
                text = self._buf[:j]
                self._space = text[len(text.rstrip()):]
                out += self._content(text.rstrip())
                self._buf, self._in_call = self._buf[j:], True
            k = self._buf.find(HERMES_CLOSE)
            if k < 0:
                body = self._buf[len(HERMES_OPEN):]
                if body.strip() and not body.lstrip().startswith("{"):
                    out += self._content(self._space + HERMES_OPEN)     # not a call: a tag named in text
                    self._buf, self._in_call, self._space = body, False, ""
                    continue
                if final:           # an unclosed call: a call if its JSON is whole, else cut short
                    cut = _partial_suffix(body.rstrip(), HERMES_CLOSE)
                    out += self._close(body.rstrip()[:len(body.rstrip()) - cut], self._buf, unclosed=True)
                    self._buf = ""
                break
            raw = self._buf[:k + len(HERMES_CLOSE)]
            out += self._close(self._buf[len(HERMES_OPEN):k], raw)
            self._buf = self._buf[k + len(HERMES_CLOSE):]
        return _merge(out)

    def _content(self, text: str) -> list[tuple[str, object]]:
        if self._after_call:
            text = text.lstrip()
        if not text or self.forced:
            return []
        self._after_call = False
        return [("content", text)]

    def _close(self, body: str, raw: str, unclosed: bool = False) -> list[tuple[str, object]]:
        """The events of a call's ``body``; ``raw``: the call's whole text (content when it is
        not a call, unless it is ``unclosed`` at the end with JSON cut short: dropped)."""
        self._in_call = False
        space, self._space = self._space, ""
        try:
            call = _call(json.loads(body))
        except ValueError:
            call = None
        if call is not None and self.names is not None and call.name not in self.names:
            call = None
        if call is None:
            return [] if unclosed and (not body.strip() or _unclosed(body)) else self._content(space + raw)
        self._after_call = True
        out = self._take([call])
        if self._done:
            self._buf = ""
        return out


def _unclosed(text: str) -> bool:
    """True when ``text`` ends inside a JSON string, object or array (JSON cut short)."""
    depth, in_str = 0, False
    for _, _, depth, in_str in _json_scan(text):
        pass
    return in_str or depth > 0


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _merge(events: list[tuple[str, object]]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for kind, value in events:
        if kind == "content" and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def parse(text: str, fmt: str = "hermes", parallel: bool = True, names=None) -> tuple[str | None, list[ToolCall]]:
    """(content outside the calls, None when there is none; the calls) of a whole answer
    (ToolCallParser's rules)."""
    parser = ToolCallParser(fmt, parallel, names)
    events = parser.feed(text) + parser.finish()
    content = "".join(v for k, v in events if k == "content")
    return (content or None), parser.calls


def template_arguments(arguments):
    """A tool call's ``arguments`` as a chat template iterates them: the JSON text parsed to an
    object (Qwen2.5's template applies ``tojson`` to it); text that is not a JSON object stays text."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments
