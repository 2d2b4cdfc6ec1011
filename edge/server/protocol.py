"""OpenAI request bodies (validated with pydantic) and the errors the server returns.

Requests follow OpenAI's Chat Completions and (legacy) Completions APIs plus llama-server's
extensions (top_k, min_p, repeat_penalty, n_predict, ignore_eos, n_probs). Unknown fields are
ignored, as OpenAI does; known fields of the wrong type or out of range are a 400 whose
``param`` names the field. Types are strict: "0.5" is not a number and true is not an integer.

Constrained decoding (edge.grammar): OpenAI's ``response_format`` json_object / json_schema on
chat, llama-server's ``json_schema`` and ``grammar`` (GBNF) on both routes; one of them per
request, and a schema or grammar llguidance refuses is a 400 naming the field.

Tool calls (edge.tool_calls): ``tools`` (function schemas), ``tool_choice`` (auto, none,
required, a named function), ``parallel_tool_calls``; assistant messages may carry
``tool_calls`` (content null) and ``role: "tool"`` messages answer them (``tool_call_id``).

A field that would change what the answer must be and that this server does not implement
(mirostat, typical_p, functions, audio ...) is a 400 naming it unless it has its
neutral value (mirostat 0, typical_p 1.0 ...): never silently dropped. Fields that do not
change the answer (user, metadata, store, cache_prompt ...) are accepted.

Bodies must be sent as ``Content-Type: application/json`` (415 otherwise) and be JSON whose
strings are Unicode text (a lone surrogate escape is a 400 naming the field), whose numbers are
finite and whose nesting the parser can hold.
"""
from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class APIError(Exception):
    """An error the client gets as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.extra = extra or {}       # more fields of the error object (llama-server's n_prompt_tokens, n_ctx)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


def check_content_type(content_type: str | None) -> None:
    """Raise APIError (415) unless the media type is application/json (parameters such as
    charset=utf-8 are allowed)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        got = f"got {content_type!r}" if content_type else "no Content-Type was sent"
        raise APIError(415, f"the request body must be JSON, sent with the header Content-Type: application/json "
                            f"({got})", code="unsupported_media_type")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")   # JSON's only way to write one


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object.

    Raises:
        APIError: 400 invalid_json for bytes that are not UTF-8 JSON, NaN / Infinity
            or a number too large for a float, nesting too deep to parse, or a value that is not
            an object; 400 invalid_value (param: the field's path) for a string holding a lone
            UTF-16 surrogate (``"\\ud800"``), which is not Unicode text.
    """
    try:                          # UTF-8 only (RFC 8259): json.loads(bytes) would take UTF-16 and
        text = raw.decode("utf-8")  # encoded surrogates ("surrogatepass")
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except ValueError as e:       # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply to parse", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    bad = _lone_surrogate(data) if _SURROGATE_ESCAPE.search(text) and not _is_unicode(data) else None
    if bad is not None:
        path, char = bad
        raise APIError(400, f"{path or 'a key'}: the string holds a lone surrogate \\u{ord(char):04x}, which is not "
                            "Unicode text", param=path or None, code="invalid_value")
    return data


def _is_unicode(data: Any) -> bool:
    """True if every string of the parsed JSON ``data`` is Unicode text (checked at C speed)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _lone_surrogate(data: Any) -> tuple[str, str] | None:
    """(dotted path, the surrogate) of the first string or key in ``data`` holding a lone
    surrogate, or None. Walks without recursion, in time linear in the size of ``data``."""
    stack: list[tuple[Any, tuple | None]] = [(data, None)]     # (value, (parent's node, key))
    while stack:
        value, node = stack.pop()
        if isinstance(value, str):
            m = _SURROGATE.search(value)
            if m:
                return _dotted(node), m.group()
        elif isinstance(value, dict):
            for key, item in value.items():
                m = _SURROGATE.search(key)
                if m:
                    return _dotted(node), m.group()
                stack.append((item, (node, key)))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, str):
                    m = _SURROGATE.search(item)
                    if m:
                        return _dotted((node, i)), m.group()
                elif isinstance(item, (dict, list)):
                    stack.append((item, (node, i)))
    return None


def _dotted(node: tuple | None) -> str:
    keys = []
    while node is not None:
        node, key = node
        keys.append(str(key))
    return ".".join(reversed(keys))


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as an OpenAI 400 naming the field (dotted path)."""
    err = e.errors(include_url=False)[0]
    loc = [str(x) for x in err.get("loc", ()) if not str(x).startswith(("function-", "constrained-"))]
    # union members appear in loc as type names ('str', 'list[int]'): keep the field path only
    param = ".".join(x for x in loc if not _is_type_label(x)) or None
    msg = err.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def _is_type_label(x: str) -> bool:
    return x in {"str", "int", "float", "bool", "list[int]", "list[str]", "list[union[str,list[int]]]"} or "[" in x


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """null for a boolean field (stream, logprobs, parallel_tool_calls ...) is its default, as
        for the other optional fields (OpenAI's spec types them ``boolean | null``)."""
        if isinstance(data, dict) and None in data.values():
            flags = {name for name, f in cls.model_fields.items() if f.annotation is bool}
            data = {k: v for k, v in data.items() if not (v is None and k in flags)}
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None                # a tool message: the call it answers
    name: str | None = None

    def template_fields(self) -> dict:
        """The tool fields as a chat template reads them (edge.tool_calls.template_arguments):
        ``tool_calls`` with each call's arguments as an object, ``tool_call_id``, ``name``."""
        from edge.tool_calls import template_arguments

        out = {}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": template_arguments(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        """The message's text: a string, or the text parts joined. Raises APIError for parts
        of other types (images, audio: this server reads text only)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        out = []
        for part in self.content:
            if part.type != "text":
                raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                               param="messages", code="unsupported_content")
            if part.text is None:
                raise APIError(400, "a content part of type 'text' needs its 'text'", param="messages",
                               code="invalid_value")
            out.append(part.text)
        return "".join(out)


Number = float  # strict float accepts JSON integers too
MAX_STOP = 16
MAX_N_PROBS = 20


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


# Fields this server does not implement, each with the test of its neutral values and how to
# write one (None: every value changes the answer, e.g. a grammar).
_Neutral = tuple[Any, str] | None
_SAMPLING_NOT_IMPLEMENTED: dict[str, _Neutral] = {
    "typical_p": (lambda v: v >= 1, "1.0"),
    "mirostat": (lambda v: v == 0, "0"),
    "dynatemp_range": (lambda v: v <= 0, "0"),
    "xtc_probability": (lambda v: v <= 0, "0"),
    "dry_multiplier": (lambda v: v == 0, "0"),
    "top_n_sigma": (lambda v: v <= 0, "-1"),
    "adaptive_target": (lambda v: v < 0, "-1"),
    "min_keep": (lambda v: v in (0, 1), "0"),
    "tfs_z": (lambda v: v >= 1, "1.0"),
    "penalize_nl": (lambda v: v is False, "false"),
    "n_indent": (lambda v: v <= 0, "0"),
    "t_max_predict_ms": (lambda v: v <= 0, "0"),
    "lora": (lambda v: v == [], "[]"),
    "image_data": (lambda v: v == [], "[]"),
    "multimodal_data": (lambda v: v == [], "[]"),
}


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value, param: str = "keep_alive") -> float | None:
    """Seconds a model stays loaded after its last request: None = forever (a negative number
    or duration), 0 = unload when idle. Takes a number of seconds or a Go duration string
    (Ollama's, time.ParseDuration: "5m", "1h30m", "300ms", "-1m", "0"; a number as text is
    seconds). Raises APIError (400, param) otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise APIError(400, f"{param}: expected seconds or a duration such as \"5m\", got {value!r}",
                         param=param, code="invalid_value")
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)
        except ValueError:
            parts = _DURATION_PART.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise APIError(400, f"{param}: {value[:40]!r} is not a duration (e.g. \"5m\", \"1h30m\", \"0\", "
                                      "\"-1m\", or a number of seconds)", param=param, code="invalid_value") from None
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
        value = sign * seconds
    return None if value < 0 else float(value)


class _KeepAlive(_Body):
    keep_alive: int | float | str | None = None   # Ollama's: how long the model stays loaded after this request

    def keep_alive_seconds(self):
        """keep_alive as seconds (None: forever), or "default" when not given (edge.server.pool).
        Raises APIError (400) for a value that is not seconds or a duration."""
        return "default" if self.keep_alive is None else parse_keep_alive(self.keep_alive)


class _Sampling(_KeepAlive):
    model: str | None = None
    max_tokens: int | None = None
    n_predict: int | None = None               # llama-server's max_tokens; -1 = no limit
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_k: int | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[Number, Field(gt=0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's range: +-100 already bans or forces a token; larger values overflow the logits
    logit_bias: dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    ignore_eos: bool = False                   # llama-server: end-of-generation tokens banned
    n_probs: Annotated[int, Field(ge=0, le=MAX_N_PROBS)] | None = None   # llama-server's logprobs count
    samplers: list[str] | str | None = None    # llama-server's sampler order (see app._check_samplers)
    # llama-server's per-request speculative decoding limits (the server's --spec-type drafts)
    speculative_n_max: int | None = Field(default=None, alias="speculative.n_max", ge=0)
    speculative_n_min: int | None = Field(default=None, alias="speculative.n_min", ge=0)
    speculative_p_min: Number | None = Field(default=None, alias="speculative.p_min", ge=0, le=1)
    # how long the model stays loaded after this request, as Ollama's keep_alive is given:
    # seconds or a duration ("5m"; 0: unload when done; negative: kept), None: the server's
    # default (edge.server.protocol.parse_keep_alive reads it); for the model pool; no answer changes
    keep_alive: int | float | str | None = None
    typical_p: Number | None = None
    mirostat: int | None = None
    dynatemp_range: Number | None = None
    xtc_probability: Number | None = None
    dry_multiplier: Number | None = None
    top_n_sigma: Number | None = None
    adaptive_target: Number | None = None
    min_keep: int | None = None
    tfs_z: Number | None = None
    penalize_nl: bool | None = None
    grammar: str | None = None
    json_schema: dict | bool | None = None
    response_format: dict | None = None        # OpenAI's (chat); on /v1/completions too
    n_indent: int | None = None
    t_max_predict_ms: int | None = None
    lora: list | None = None
    image_data: list | None = None
    multimodal_data: list | None = None

    NOT_IMPLEMENTED: ClassVar[dict[str, _Neutral]] = _SAMPLING_NOT_IMPLEMENTED

    def stop_list(self) -> list[str]:
        """The stop strings; raises APIError (400) for more than MAX_STOP."""
        if self.stop is None:
            return []
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(self.stop)}", param="stop",
                           code="invalid_value")
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_not_implemented(self) -> None:
        """Raise APIError (400 unsupported_value, param: the field) for the first field this
        server does not implement that is given with a value other than its neutral one."""
        for name, neutral in self.NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if value is None or (neutral is not None and neutral[0](value)):
                continue
            how = f"leave it out or send {name}: {neutral[1]}" if neutral else "leave it out"
            raise APIError(400, f"{name} = {_short(value)} is not supported by this server: it would change the "
                                f"answer; {how}", param=name, code="unsupported_value")

    def check_unsupported(self) -> None:
        """Raise APIError (400) for a response_format without a type or of another type than
        text, json_object or json_schema; the rest of NOT_IMPLEMENTED is check_not_implemented's."""
        self._response_format_kind()

    def _response_format_kind(self) -> str:
        rf = self.response_format
        if rf is None:
            return "text"
        if "type" not in rf:
            raise APIError(400, "Missing required parameter: 'response_format.type' (one of "
                                f"{', '.join(RESPONSE_FORMATS)})", param="response_format.type", code="invalid_value")
        kind = rf["type"]
        if kind not in RESPONSE_FORMATS:
            raise APIError(400, f"response_format type {_short(kind)} is not supported by this server (one of "
                                f"{', '.join(RESPONSE_FORMATS)})", param="response_format", code="unsupported_value")
        return kind

    def constraint(self):
        """(the edge.grammar.Grammar this request constrains its answer with, the field that
        asked) or (None, None): OpenAI's response_format json_object (any JSON object, or
        llama-server's ``schema`` beside it) or json_schema (``json_schema.schema``; absent: any
        JSON value), llama-server's json_schema or grammar (GBNF; "" or blanks: none).

        Raises:
            APIError: 400 (param: the field) for two constraints at once, a response_format
                without a type or of an unknown one, a json_schema without a valid ``name``
                (OpenAI's ``^[a-zA-Z0-9_-]{1,64}$``) or with a non-boolean ``strict``, or a
                schema / grammar llguidance cannot convert.
        """
        from edge.grammar import GrammarError, any_json_object, json_schema

        kind = self._response_format_kind()
        if kind == "text":
            return self._llama_constraint()
        rf = self.response_format
        if self.json_schema is not None or (self.grammar or "").strip():
            other = "json_schema" if self.json_schema is not None else "grammar"
            raise APIError(400, f"response_format: {kind} and {other} both constrain the answer: give one",
                           param="response_format", code="invalid_value")
        if kind == "json_object":
            schema = rf.get("schema")
        else:
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise APIError(400, "response_format: type json_schema needs a json_schema object ({\"name\": ..., "
                                    "\"schema\": {...}})", param="response_format", code="invalid_value")
            name = spec.get("name")
            if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
                raise APIError(400, "response_format.json_schema.name: must be 1-64 letters, digits, '_' or '-', got "
                                    f"{_short(name)}", param="response_format.json_schema.name", code="invalid_value")
            if not isinstance(spec.get("strict", False), (bool, type(None))):
                raise APIError(400, f"response_format.json_schema.strict: must be a boolean, got "
                                    f"{_short(spec['strict'])}", param="response_format.json_schema.strict",
                               code="invalid_value")
            schema = spec.get("schema", True)
        try:
            return (any_json_object() if schema is None else json_schema(schema)), "response_format"
        except GrammarError as e:
            raise APIError(400, f"response_format: {e}", param="response_format", code="invalid_value") from None

    def _llama_constraint(self):
        """llama-server's json_schema or grammar (constraint's)."""
        from edge.grammar import GrammarError, gbnf, json_schema

        if self.grammar is not None and not self.grammar.strip():
            self.grammar = None                    # llama-server: an empty grammar is none
        if self.grammar and self.json_schema is not None:
            raise APIError(400, "grammar: give either json_schema or grammar, not both", param="grammar",
                           code="invalid_value")
        param = "json_schema" if self.json_schema is not None else "grammar" if self.grammar else None
        if param is None:
            return None, None
        try:
            return (json_schema(self.json_schema) if param == "json_schema" else gbnf(self.grammar)), param
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None

    def max_tokens_given(self) -> tuple[int | None, str]:
        """(the token limit asked for, the field that asked): max_tokens, else n_predict (its -1,
        no limit, as None). Raises APIError (400) for n_predict 0 or below -1."""
        if self.max_tokens is not None or self.n_predict is None:
            return self.max_tokens, "max_tokens"
        if self.n_predict == -1:
            return None, "n_predict"
        if self.n_predict < 1:
            raise APIError(400, f"n_predict must be -1 (no limit) or at least 1, got {self.n_predict}",
                           param="n_predict", code="invalid_value")
        return self.n_predict, "n_predict"




class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None                  # edge.tool_calls.check_tools
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # not served: a request that depends on them gets a 400 rather than a silent plain answer
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None
    # reasoning models (edge.server.thinking): "none" turns thinking off; others reach the template
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: dict | None = None   # extra chat template variables (JSON scalars)

    NOT_IMPLEMENTED: ClassVar[dict[str, _Neutral]] = {
        **_SAMPLING_NOT_IMPLEMENTED,
        "functions": (lambda v: v == [], "[]"),
        "function_call": (lambda v: v in ("none", "auto"), '"none"'),
        "modalities": (lambda v: v in ([], ["text"]), '["text"]'),
        "audio": None,
        "verbosity": None,
        "web_search_options": None,
    }

    def check_tool_messages(self) -> None:
        """OpenAI's rules for ``role: "tool"`` messages (its chat route; other APIs' adapters have
        their own): each answers a call of the assistant message before it (other tool messages
        between them), by its ``tool_call_id`` when it has one (left out, as llama-server takes
        it: OpenAI would 400).

        Raises:
            APIError: 400 naming the message (``messages.N.tool_call_id`` / ``messages.N``).
        """
        calls = None                     # the ids of the last assistant's calls (None: no calls)
        for i, m in enumerate(self.messages):
            if m.role == "assistant":
                calls = {c.id for c in m.tool_calls} if m.tool_calls else None
            elif m.role != "tool":
                calls = None
            elif calls is None:
                raise APIError(400, f"messages.{i}: messages with role 'tool' must be a response to a preceding "
                                    "message with 'tool_calls'", param=f"messages.{i}", code="invalid_value")
            elif m.tool_call_id is not None and None not in calls and m.tool_call_id not in calls:
                raise APIError(400, f"messages.{i}.tool_call_id: {_short(m.tool_call_id)} is not the id of a call of "
                                    "the assistant message before it", param=f"messages.{i}.tool_call_id",
                               code="invalid_value")

    def tool_setup(self):
        """(mode "auto" / "none" / "required", the tools to render, the tools a call may use)
        from tools, tool_choice (edge.tool_calls). Raises APIError (400 invalid_value, param:
        the entry) for a tool that is not a function schema or a bad tool_choice."""
        from edge.tool_calls import ToolError, check_tools, chosen_tools

        try:
            tools = check_tools(self.tools) if self.tools is not None else []
            mode, allowed = chosen_tools(tools, self.tool_choice)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        return mode, (tools if mode != "none" else []), allowed


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    progress: bool = False          # edge's own: Progress events while the prompt is computed (/completion's
                                    # return_progress; set before submission, or the first step could pass unseen)

    NOT_IMPLEMENTED: ClassVar[dict[str, _Neutral]] = {
        **_SAMPLING_NOT_IMPLEMENTED, "best_of": (lambda v: v == 1, "1")}


class ModelRequest(_KeepAlive):
    """POST /models/load and /models/unload."""
    model: str


class TokenizeRequest(_Body):
    model: str | None = None
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False                  # llama-server: [{"id", "piece"}] instead of ids


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def token_pieces(tok, ids: list[int]) -> list[dict]:
    """/tokenize's ``with_pieces``: [{"id", "piece"}], the piece a string when its bytes are
    valid UTF-8, else the list of its byte values (special tokens as their text)."""
    out = []
    for t in ids:
        raw = tok.token_to_piece(int(t), special=True)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": int(t), "piece": piece})
    return out
