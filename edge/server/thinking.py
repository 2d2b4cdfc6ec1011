"""Reasoning models in /v1/chat/completions: template variables, the budget, the split answer.

A request turns thinking off with ``chat_template_kwargs: {"enable_thinking": false}`` (the
variable Qwen3's template reads) or ``reasoning_effort: "none"`` (the same variable); other
``reasoning_effort`` values reach the template as the variable ``reasoning_effort`` (gpt-oss's
template reads it; others ignore it). ``chat_template_kwargs`` holds JSON scalars only: a string
holding a control token's text is a 400, since the rendered prompt is tokenized with special
tokens parsed (BUGS.md T2).

For a reasoning model (edge.reasoning.is_reasoning_model) the answer's ``<think>`` block goes
to ``message.reasoning_content`` and ``message.reasoning`` (llama-server's name and the newer
one; both), streamed as ``delta.reasoning_content`` / ``delta.reasoning`` chunks before the
content chunks. ``--reasoning-budget N`` (-1: no limit) closes the block after N tokens
(edge.reasoning.ReasoningBudget); 0 also renders the template with ``enable_thinking`` false,
as llama-server does. A request constrained by a grammar or JSON schema is not split: the
constraint holds from the first token (llama.cpp's lazy grammar after ``</think>`` is not done).
"""
from __future__ import annotations

from edge.reasoning import ReasoningBudget, ReasoningSplitter, Split, is_reasoning_model, prompt_opens_reasoning
from edge.server import protocol as P
from edge.tokenizer import TokenAttr

# ChatTemplate.render's own, and tools (the request's tools field)
_RESERVED = ("self", "messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


def template_variables(body, tokenizer, reasoning_budget: int = -1) -> dict:
    """The extra chat template variables of a chat request ``body`` (module docstring).

    Raises:
        APIError: 400 (param ``chat_template_kwargs.KEY``) for a variable render() sets itself
            (messages ...), a value that is not a JSON scalar, or a string holding a control token's text.
    """
    variables: dict = {}
    if reasoning_budget == 0:
        variables["enable_thinking"] = False
    effort = body.reasoning_effort
    if effort == "none":
        variables["enable_thinking"] = False
    elif effort is not None:
        variables["reasoning_effort"] = effort
    for key, value in (body.chat_template_kwargs or {}).items():
        param = f"chat_template_kwargs.{key}"
        if key in _RESERVED:
            raise P.APIError(400, f"{param}: the server sets this template variable itself", param=param,
                             code="invalid_value")
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise P.APIError(400, f"{param}: only strings, numbers, booleans and null are passed to the chat "
                                  f"template, got {type(value).__name__}", param=param, code="invalid_value")
        if isinstance(value, str) and _has_special(tokenizer, value):
            raise P.APIError(400, f"{param}: the text holds a control token of the model, which a template "
                                  "variable may not carry", param=param, code="invalid_value")
        variables[key] = value
    return variables


def _has_special(tokenizer, text: str) -> bool:
    """True when ``text`` tokenized with special tokens parsed holds a control token (user-defined
    tokens are matched in plain text too, so they forge nothing)."""
    return any(tokenizer.token_attr(t) & TokenAttr.CONTROL for t in tokenizer.encode(text, add_special=False,
                                                                              parse_special=True))


class ChatReasoning:
    """One chat request's reasoning: the splitter of its answer (None for a model that does not
    reason) and its budget processor.

    Args:
        engine: the server's Engine (its tokenizer and chat template).
        prompt_ids: the request's prompt tokens.
        budget: --reasoning-budget (-1: no limit).
        constrained: a grammar or JSON schema governs every generated token (edge.grammar), so
            there is no reasoning to split off or to budget: the whole text is the content.
    """

    def __init__(self, engine, prompt_ids: list[int], budget: int = -1, constrained: bool = False):
        tok = engine.tokenizer
        source = engine.template.source if engine.template is not None else None
        self.enabled = not constrained and is_reasoning_model(source, tok)
        opened = self.enabled and prompt_opens_reasoning(tok, prompt_ids)
        self.splitter = ReasoningSplitter(opened) if self.enabled else None
        self.processors = [ReasoningBudget(tok, len(prompt_ids), budget, opened)] if self.enabled and budget >= 0 else []

    def message(self, text: str) -> dict:
        """The non-streamed ``message`` for the whole answer ``text``."""
        if self.splitter is None:
            return {"role": "assistant", "content": text}
        self.splitter.push(text)
        self.splitter.finish()
        return self._fields({"role": "assistant", "content": self.splitter.content}, self.splitter.reasoning)

    def deltas(self, text: str, final: bool = False) -> list[dict]:
        """The ``delta`` objects for a streamed piece of the answer (``final``: the answer ended,
        release what the splitter held), reasoning first; [] when nothing is released."""
        if self.splitter is None:
            return [{"content": text}] if text else []
        out: Split = self.splitter.push(text)
        if final:
            rest = self.splitter.finish()
            out = Split(out.reasoning + rest.reasoning, out.content + rest.content)
        deltas = [self._fields({}, out.reasoning)] if out.reasoning else []
        return deltas + ([{"content": out.content}] if out.content else [])

    def empty_delta(self) -> dict:
        """A delta with no text (for logprobs of tokens whose text is held): reasoning-shaped
        while the answer is in (or may open) its reasoning, else content."""
        if self.splitter is not None and self.splitter.in_reasoning:
            return {"reasoning_content": "", "reasoning": ""}
        return {"content": ""}

    @staticmethod
    def _fields(obj: dict, reasoning: str) -> dict:
        if reasoning:
            obj["reasoning_content"] = obj["reasoning"] = reasoning
        return obj
