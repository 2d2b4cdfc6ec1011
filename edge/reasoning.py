"""Reasoning models: the ``<think> ... </think>`` block split from the answer, and its budget.

Reasoning models (Qwen3, DeepSeek-R1-Distill, QwQ) write their reasoning between ``<think>``
and ``</think>`` before the answer. llama-server returns it as ``reasoning_content`` (its
``--reasoning-format deepseek``); the rules here follow its parser (common/chat-parser.cpp,
``try_parse_reasoning``):

- a reasoning block is recognised only at the start of the generated text (after leading
  whitespace); ``<think>`` later in the answer is answer text;
- when the chat template already wrote ``<think>`` at the end of the prompt (DeepSeek-R1's
  generation prompt is ``<｜Assistant｜><think>\\n``), the generated text starts inside it;
- a block that never closes (max_tokens, a stop) is all reasoning;
- whitespace around the reasoning and between ``</think>`` and the answer is dropped.

:class:`ReasoningSplitter` does this on streamed text and never releases part of a tag: text
that could still become ``<think>`` or ``</think>`` (and whitespace that may turn out to end
the reasoning) is held back until the next piece decides it, as edge.textstream holds back a
possible stop string. :class:`ReasoningBudget` is a logits processor (edge.sampling's mask
stage) that closes the reasoning after N tokens by forcing the tokens of ``</think>``
(llama-server's ``--reasoning-budget``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
_TEMPLATE_MARKERS = (OPEN_TAG, CLOSE_TAG, "reasoning_content", "enable_thinking")
_PROMPT_TAIL_TOKENS = 8        # prompt tokens decoded to see whether the template opened <think>


@dataclass
class Split:
    """What one call released: ``reasoning`` text, then ``content`` text (either may be "");
    within one call the reasoning always comes first (the block precedes the answer)."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Splits streamed text into reasoning and answer (module docstring).

    Args:
        opened: the prompt already ends with ``<think>``: the text starts inside the reasoning.

    Call :meth:`push` with each released piece of text and :meth:`finish` at the end; the
    reasoning and content released so far are in ``reasoning`` and ``content``.
    """

    _START, _REASONING, _GAP, _CONTENT = range(4)   # _GAP: after </think>, before the answer

    def __init__(self, opened: bool = False):
        self._state = self._REASONING if opened else self._START
        self._lead = opened           # leading whitespace of the reasoning still to drop
        self._held = ""
        self.reasoning = ""
        self.content = ""

    @property
    def in_reasoning(self) -> bool:
        """True while the text goes to the reasoning (or may still open it)."""
        return self._state in (self._START, self._REASONING)

    def push(self, text: str) -> Split:
        """Add a piece of text; returns what can be released now."""
        self._held += text
        out = Split()
        if self._state == self._START:
            body = self._held.lstrip()
            if body.startswith(OPEN_TAG):
                self._held, self._state, self._lead = body[len(OPEN_TAG):], self._REASONING, True
            elif OPEN_TAG.startswith(body):          # "", or a piece of the tag: wait
                return out
            else:
                self._state = self._CONTENT
        if self._state == self._REASONING:
            if self._lead:
                self._held = self._held.lstrip()
                self._lead = not self._held
            end = self._held.find(CLOSE_TAG)
            if end == -1:
                keep = len(self._held) - _hold_back(self._held, CLOSE_TAG)
                out.reasoning, self._held = self._held[:keep], self._held[keep:]
            else:
                out.reasoning = self._held[:end].rstrip()
                self._held, self._state = self._held[end + len(CLOSE_TAG):], self._GAP
        if self._state == self._GAP:
            self._held = self._held.lstrip()
            if self._held:
                self._state = self._CONTENT
        if self._state == self._CONTENT:
            out.content, self._held = self._held, ""
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def finish(self) -> Split:
        """The text ended: release what was held (an unclosed block's tail is reasoning, a piece
        of ``<think>`` at the start is answer text; whitespace at the end of the reasoning is dropped)."""
        out = Split()
        if self._state == self._START:
            out.content = self._held
        elif self._state == self._REASONING:
            out.reasoning = self._held.rstrip()
        self._held = ""
        self.reasoning += out.reasoning
        self.content += out.content
        return out


def split_reasoning(text: str, opened: bool = False) -> Split:
    """The reasoning and the answer of a whole text (ReasoningSplitter in one piece)."""
    s = ReasoningSplitter(opened)
    s.push(text)
    s.finish()
    return Split(s.reasoning, s.content)


def _hold_back(text: str, tag: str) -> int:
    """Characters at the end of ``text`` to hold: the longest tail that starts ``tag``, plus
    the whitespace before it (it ends the reasoning if the tag follows)."""
    n = next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
    return len(text) - len(text[: len(text) - n].rstrip())


def is_reasoning_model(template_source: str | None, tokenizer) -> bool:
    """True when the chat template mentions ``<think>`` / ``</think>`` / ``reasoning_content`` /
    ``enable_thinking``, or the vocabulary has ``<think>`` and ``</think>`` as single tokens."""
    if template_mentions_reasoning(template_source):
        return True
    return tag_ids(tokenizer, OPEN_TAG) is not None and tag_ids(tokenizer, CLOSE_TAG) is not None


def template_mentions_reasoning(template_source: str | None) -> bool:
    """True when a chat template's text mentions one of ``<think>``, ``</think>``,
    ``reasoning_content``, ``enable_thinking`` (is_reasoning_model's test of the template)."""
    return bool(template_source) and any(m in template_source for m in _TEMPLATE_MARKERS)


def tag_ids(tokenizer, tag: str) -> list[int] | None:
    """``[id]`` when ``tag`` is one token of the vocabulary (a special or user-defined token),
    else None."""
    ids = tokenizer.encode(tag, add_special=False, parse_special=True)
    if len(ids) == 1 and tokenizer.token_to_piece(ids[0], special=True) == tag.encode():
        return [int(ids[0])]
    return None


def prompt_opens_reasoning(tokenizer, prompt_ids: Sequence[int]) -> bool:
    """True when the prompt's text ends with ``<think>`` (and whitespace): the chat template
    opened the reasoning, so the generated text starts inside it."""
    tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), unparse_special=True)
    return tail.decode("utf-8", errors="replace").rstrip().endswith(OPEN_TAG)


class ReasoningBudget:
    """A logits processor that closes the reasoning after ``budget`` tokens by forcing the
    tokens of ``</think>`` one by one (every other token banned), as llama-server's
    ``--reasoning-budget``.

    Args:
        tokenizer: the model's edge.tokenizer.Tokenizer.
        n_prompt: prompt tokens at the start of the history the processor is called with.
        budget: reasoning tokens allowed (>= 0; 0 closes the block at once).
        opened: the prompt ended with ``<think>`` (the reasoning starts with the first token).
    Raises:
        ValueError: a negative budget.

    The reasoning counts from the token after the ``<think>`` tokens when these are the first
    generated tokens (else there is no block and nothing is forced); a ``</think>`` the model
    wrote itself ends the count. State is read from the history on each call, so rows sampled
    from a speculative draft and taken back are no trouble.
    """

    def __init__(self, tokenizer, n_prompt: int, budget: int, opened: bool = False):
        if budget < 0:
            raise ValueError(f"reasoning budget must be >= 0, got {budget}")
        self._open = tokenizer.encode(OPEN_TAG, add_special=False, parse_special=True)
        self._close = tokenizer.encode(CLOSE_TAG, add_special=False, parse_special=True)
        self._n_prompt, self._budget, self._opened = n_prompt, budget, opened
        self._closed_at: int | None = None     # where a </think> was last seen (checked again each call)

    def __call__(self, history: Sequence[int], logits: np.ndarray) -> np.ndarray:
        start = self._reasoning_start(history)
        if start is None or len(history) - start < self._budget or self._closed(history, start):
            return logits
        close, n = self._close, len(history)
        done = next((k for k in range(min(len(close) - 1, n - start), 0, -1)
                     if list(history[n - k:]) == close[:k]), 0)
        forced = close[done]
        keep = logits[forced]
        logits[:] = -np.inf
        logits[forced] = keep if np.isfinite(keep) else 0.0
        return logits

    def _reasoning_start(self, history: Sequence[int]) -> int | None:
        """Index in ``history`` of the first reasoning token, or None (no block)."""
        if self._opened:
            return self._n_prompt
        end = self._n_prompt + len(self._open)
        if len(history) >= end and list(history[self._n_prompt:end]) == self._open:
            return end
        return None

    def _closed(self, history: Sequence[int], start: int) -> bool:
        """True when the tokens of ``</think>`` appear in history after ``start``."""
        close, at = self._close, self._closed_at
        if at is not None and at >= start and list(history[at:at + len(close)]) == close:
            return True
        first = close[0]
        for i in range(len(history) - len(close), start - 1, -1):
            if history[i] == first and list(history[i:i + len(close)]) == close:
                self._closed_at = i
                return True
        return False
