"""A tiny random "reasoning" model: tests/tiny_chat.py's ChatML qwen2 with ``<think>`` and
``</think>`` as user-defined tokens (as in Qwen3's GGUF), word tokens to write a known answer
with, the tags also in pieces (``<`` ``think`` ``>``, ``</`` ``th`` ``ink>``), a newline, and a ChatML
template that, like Qwen3's, writes an empty think block when ``enable_thinking`` is false and,
like DeepSeek-R1's, opens ``<think>`` in the generation prompt when ``open_think`` is true.

The random model writes a chosen token sequence through :func:`driving_body`: every other
token banned by logit_bias, the chosen ones biased in falling steps, and a repeat penalty that
sinks each token once it is written, so greedy decoding takes them in order."""
from __future__ import annotations

from pathlib import Path

from tests import tiny_models
from tests.tiny_chat import _ChatWriter

N_VOCAB = 96
WORDS = ["<think>", "</think>", "Hmm", "▁ok", "<", "think", ">", "</", "th", "ink>", "The", "▁answer", "▁is",
         "▁4", ".", "<0x0A>", "▁", "\n\n", "▁▁", "\t"]
FIRST_WORD = 3                          # WORDS[i] is token FIRST_WORD + i
ID = {w: FIRST_WORD + i for i, w in enumerate(WORDS)}
_USER_DEFINED, _BYTE = 4, 6             # gguf.TokenType
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if open_think %}<think>\n{% elif enable_thinking is defined and not enable_thinking %}"
            "<think>\n\n</think>\n\n{% endif %}{% endif %}")

# token sequences and the text they decode to
WHOLE_TAGS = ["<think>", "Hmm", "▁ok", "</think>", "The", "▁answer", "▁is", "▁4", "."]
SPLIT_TAGS = ["<", "think", ">", "Hmm", "▁ok", "</", "th", "ink>", "The", "▁answer", "▁is", "▁4", "."]
OPENED = ["Hmm", "▁ok", "</think>", "The", "▁answer", "▁is", "▁4", "."]       # after a prompt's <think>
NO_THINK = ["The", "▁answer", "▁is", "▁4", "."]
# whitespace around the reasoning and before the answer (tokens the prompt does not use)
SPACED = ["<think>", "\n\n", "Hmm", "▁ok", "▁▁", "</think>", "\t", "The", "▁answer", "▁is", "▁4", "."]
REASONING, ANSWER = "Hmm ok", "The answer is 4."


class _ReasoningWriter(_ChatWriter):
    def add_token_list(self, tokens):
        tokens = list(tokens)
        tokens[FIRST_WORD:FIRST_WORD + len(WORDS)] = WORDS
        super().add_token_list(tokens)

    def add_token_types(self, types):
        types = list(types)
        types[ID["<think>"]] = types[ID["</think>"]] = _USER_DEFINED
        types[ID["<0x0A>"]] = _BYTE
        super().add_token_types(types)

    def add_chat_template(self, value):
        super().add_chat_template(TEMPLATE)


def write_tiny_reasoning_model(path: Path, monkeypatch) -> Path:
    """Write the tiny reasoning model to ``path`` (``monkeypatch``: a pytest MonkeyPatch, used for
    the writer while writing). Returns the path."""
    with monkeypatch.context() as mp:
        mp.setattr(tiny_models, "GGUFWriter", _ReasoningWriter)
        tiny_models.write_tiny_model(path, arch="qwen2", n_vocab=N_VOCAB)
    return path


def driving_body(words: list[str]) -> dict:
    """Request fields that make the model write ``words`` (greedy, len(words) tokens)."""
    bias = {str(t): -100.0 for t in range(N_VOCAB)}
    for i, w in enumerate(words):
        bias[str(ID[w])] = 100.0 - 7.0 * i
    return {"logit_bias": bias, "temperature": 0.0, "repeat_penalty": 1e4, "repeat_last_n": -1,
            "max_tokens": len(words)}
