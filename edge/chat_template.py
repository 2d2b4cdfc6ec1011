"""Chat templates: render a GGUF's ``tokenizer.chat_template`` into a prompt string.

The template is a Jinja2 template written for Hugging Face transformers, so it is rendered
the way transformers does it (``transformers.utils.chat_template_utils._compile_jinja_template``
and ``apply_chat_template``), which is also what llama-cpp-python's ``Jinja2ChatFormatter``
does and what produced the goldens in ``golden/<model>/chat.json``:

- jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks`` and the
  ``jinja2.ext.loopcontrols`` extension (``{% break %}``, ``{% continue %}``);
- globals ``raise_exception(message)`` and ``strftime_now(format)``;
- a ``tojson`` filter that is ``json.dumps`` with ``ensure_ascii=False`` and the ``indent``,
  ``separators`` and ``sort_keys`` options (jinja2's own filter escapes HTML characters);
- variables ``messages``, ``add_generation_prompt``, ``tools`` (None unless given),
  ``bos_token`` and ``eos_token`` (token text from the vocabulary) and any extra keyword.

The template is untrusted input (a GGUF file from anywhere; ../shared/BUGS.md C1). The sandbox
refuses ``__class__``/``__globals__`` walks (here as an error, not an empty string) and
mutation of lists and dicts; on top of it every render runs under a budget of steps, sizes,
time and memory (:mod:`edge.template_budget`), so a template can neither hang a turn nor build
gigabytes. Every failure (parse error, ``raise_exception``, sandbox violation, runtime error,
budget overrun) is a :class:`ChatTemplateError` whose message is fit to show the user as an
HTTP 400 (C2).

The rendered text may begin with ``bos_token``; whoever tokenizes it must not add a second BOS
(BUGS.md T3).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Sequence

import jinja2

from edge import template_budget, template_sandbox
from edge.gguf_file import GGUFError, GGUFFile
from edge.template_budget import RenderBudgetError

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
TOKENS_KEY = "tokenizer.ggml.tokens"
BOS_ID_KEY = "tokenizer.ggml.bos_token_id"
EOS_ID_KEY = "tokenizer.ggml.eos_token_id"

# exceptions a template can raise while rendering; all of them are the template's fault
_RENDER_ERRORS = (
    jinja2.TemplateError,
    ArithmeticError,
    LookupError,
    TypeError,
    ValueError,
    AttributeError,
    RecursionError,
)


class ChatTemplateError(ValueError):
    """A chat template failed: it did not parse, called ``raise_exception``, tripped the sandbox,
    failed at run time, or was given malformed messages. The message is meant for the user."""


class ChatTemplateBudgetError(ChatTemplateError):
    """A chat template went over a render budget (steps, size, output, time, memory)."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no ``tokenizer.chat_template``; it can only be used for raw completion."""


class _RaisedByTemplate(jinja2.TemplateError):
    """Raised by the template's own ``raise_exception(message)`` call."""


def _raise_exception(message: Any) -> None:
    raise _RaisedByTemplate(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> jinja2.Environment:
    env = template_sandbox.make_environment()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (_RaisedByTemplate, RenderBudgetError)):
        return str(exc)
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"chat template does not parse (line {exc.lineno}): {exc.message}"
    if isinstance(exc, jinja2.sandbox.SecurityError):
        return f"chat template tried an unsafe operation: {exc}"
    return f"chat template failed to render: {type(exc).__name__}: {exc}"


def validate_messages(messages: Any) -> None:
    """Check the shape of a chat: a non-empty list of dicts, each with a string ``role`` and a
    string or None ``content`` (other keys, e.g. ``tool_calls``, pass through unchecked).

    Raises:
        ChatTemplateError: naming the first problem, e.g. ``messages[2].role must be a string``.
    """
    if not isinstance(messages, list):
        raise ChatTemplateError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}].role must be a string")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ChatTemplateError(
                f"messages[{i}].content must be a string or null, got {type(content).__name__}")


class ChatTemplate:
    """A compiled chat template (see the module docstring for the rendering rules).

    Args:
        source: the Jinja2 template text (``tokenizer.chat_template``).
        bos_token, eos_token: the text of the BOS and EOS tokens ("" when the model has none).

    Raises:
        ChatTemplateError: the template does not parse.
    """

    def __init__(self, source: str, bos_token: str, eos_token: str):
        if not isinstance(source, str):
            raise ChatTemplateError(f"chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = template_sandbox.compile_template(_make_environment(), source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(_describe(exc)) from exc

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "ChatTemplate | None":
        """The template of a GGUF file, or None when it has no ``tokenizer.chat_template`` (or
        an empty one, which would render every conversation as "").

        bos_token/eos_token are the vocabulary entries ``tokenizer.ggml.tokens[bos/eos id]``
        ("" when the id key is absent).

        Raises:
            GGUFError: the template is not a string, or a token id is not an index of the vocabulary.
            ChatTemplateError: the template does not parse.
        """
        source = gf.get(CHAT_TEMPLATE_KEY)
        if source is None:
            return None
        if not isinstance(source, str):
            raise GGUFError(f"{CHAT_TEMPLATE_KEY} must be a string, got {type(source).__name__}")
        if not source.strip():
            return None          # an empty template renders nothing: the model has none
        tokens = gf.get(TOKENS_KEY, [])
        return cls(source, _token_text(tokens, gf.get(BOS_ID_KEY), BOS_ID_KEY),
                   _token_text(tokens, gf.get(EOS_ID_KEY), EOS_ID_KEY))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """Render ``messages`` into the prompt text.

        Args:
            messages: ``[{"role": str, "content": str | None, ...}, ...]``, non-empty.
            add_generation_prompt: append the header that opens the assistant's turn.
            **kwargs: extra template variables (``tools``, ``documents``, ``enable_thinking`` ...);
                they may not override ``messages``, ``add_generation_prompt``, ``bos_token`` or
                ``eos_token``.

        Raises:
            ChatTemplateError: malformed messages, or the template failed; for
                ``raise_exception(msg)`` the error's message is exactly ``msg``.
        """
        validate_messages(messages)
        fixed = {"messages": messages, "add_generation_prompt": bool(add_generation_prompt),
                 "bos_token": self.bos_token, "eos_token": self.eos_token}
        clash = sorted(fixed.keys() & kwargs.keys())
        if clash:
            raise ChatTemplateError(f"template variables {clash} are set by render() itself")
        variables = {"tools": None, **kwargs, **fixed}
        try:
            return template_budget.render(self._template, variables)
        except RenderBudgetError as exc:
            raise ChatTemplateBudgetError(_describe(exc)) from exc
        except _RENDER_ERRORS as exc:
            raise ChatTemplateError(_describe(exc)) from exc


def _token_text(tokens: Sequence[str], token_id: Any, key: str) -> str:
    if token_id is None:
        return ""
    if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
        raise GGUFError(f"{key} = {token_id!r} is not an index of {TOKENS_KEY} "
                        f"({len(tokens)} tokens)")
    return tokens[token_id]


def require_template(gf_or_template: GGUFFile | ChatTemplate | None, model_name: str) -> ChatTemplate:
    """The chat template to use for ``model_name``, or a clear error when it has none (BUGS.md C3).

    Args:
        gf_or_template: an open GGUF file, an already built template, or None (what
            :meth:`ChatTemplate.from_gguf` returns for a model without one).
        model_name: the name shown in the error.

    Raises:
        NoChatTemplateError: the model has no chat template; the message says raw completion
            (``--raw``) is the way to use it.
    """
    template = gf_or_template
    if isinstance(template, GGUFFile):
        template = ChatTemplate.from_gguf(template)
    if template is None:
        raise NoChatTemplateError(
            f"model {model_name!r} has no chat template ({CHAT_TEMPLATE_KEY} is not in its GGUF "
            f"file), so it cannot be used for chat; use raw completion (--raw) instead")
    if not isinstance(template, ChatTemplate):
        raise TypeError(f"expected a GGUFFile, ChatTemplate or None, got {type(template).__name__}")
    return template
