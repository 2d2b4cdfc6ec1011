"""OpenAI request bodies (validated with pydantic) and the errors the server returns.

Requests follow OpenAI's Chat Completions and (legacy) Completions APIs plus llama-server's
sampling extensions (top_k, min_p, repeat_penalty). Unknown fields are ignored, as OpenAI does;
known fields of the wrong type or out of range are a 400 whose ``param`` names the field.
Types are strict: "0.5" is not a number and true is not an integer.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error the client gets as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text: a string, or the text parts joined. Raises APIError for parts
        of other types (images, audio: this server reads text only)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                               param="messages", code="unsupported_content")
            out.append(part.text)
        return "".join(out)


Number = float  # strict float accepts JSON integers too
MAX_STOP = 16


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
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

    def stop_list(self) -> list[str]:
        """The stop strings; raises APIError (400) for more than MAX_STOP."""
        if self.stop is None:
            return []
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(self.stop)}", param="stop",
                           code="invalid_value")
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # not served yet: a request that depends on them gets a 400 rather than a silent plain answer
    tools: list | None = None
    response_format: dict | None = None

    def check_unsupported(self) -> None:
        """Raise APIError (400) for features this server does not provide: tool calling, and a
        response_format other than plain text (JSON mode / schemas)."""
        if self.tools:
            raise APIError(400, "tools (function calling) are not supported by this server", param="tools",
                           code="unsupported_value")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise APIError(400, f"response_format {kind!r} is not supported by this server (only 'text')",
                           param="response_format", code="unsupported_value")


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False
    parse_special: bool = True


class DetokenizeRequest(_Body):
    tokens: list[int]
