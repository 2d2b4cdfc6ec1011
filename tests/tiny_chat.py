"""A tiny random model that can chat: tests/tiny_models.py's qwen2 with ChatML control tokens
and a ChatML chat template, for server tests that need a template and special tokens but not
a real model (it loads in a second)."""
from __future__ import annotations

from pathlib import Path

from gguf import GGUFWriter

from tests import tiny_models

IM_START, IM_END = 1, 2                 # token ids of <|im_start|> and <|im_end|>
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CONTROL = 3                            # gguf.TokenType.CONTROL


class _ChatWriter(GGUFWriter):
    """GGUFWriter that gives tokens 1 and 2 the ChatML texts as control tokens, 2 as EOS, and
    the ChatML template."""

    def add_token_list(self, tokens):
        tokens = list(tokens)
        tokens[IM_START], tokens[IM_END] = "<|im_start|>", "<|im_end|>"
        super().add_token_list(tokens)

    def add_token_types(self, types):
        types = list(types)
        types[IM_START] = types[IM_END] = _CONTROL
        super().add_token_types(types)

    def write_header_to_file(self, *args, **kw):
        self.add_chat_template(CHATML)
        self.add_eos_token_id(IM_END)
        return super().write_header_to_file(*args, **kw)


def write_tiny_chat_model(path: Path, monkeypatch, **kw) -> Path:
    """Write the tiny ChatML model to ``path`` (``monkeypatch``: a pytest MonkeyPatch, used for
    the writer while writing; ``kw``: more of tiny_models.write_tiny_model's arguments, e.g.
    ``tokens`` and ``n_vocab``). Returns the path."""
    with monkeypatch.context() as mp:
        mp.setattr(tiny_models, "GGUFWriter", _ChatWriter)
        tiny_models.write_tiny_model(path, arch="qwen2", **kw)
    return path
