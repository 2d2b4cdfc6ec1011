"""Byte-level BPE pre-tokenization, as llama.cpp does it before applying merges.

Three pieces, each mirroring a llama.cpp function (src/unicode.cpp, src/llama-vocab.cpp):

- :func:`decode_utf8_lossy` reads UTF-8 like ``unicode_cpts_from_utf8``: a byte that does not
  start a complete sequence becomes one U+FFFD and reading resumes at the next byte.
- :data:`BYTE_TO_UNICODE` is the GPT-2 byte -> printable character table
  (``unicode_byte_to_utf8_map``): bytes ``!``..``~``, ``¡``..``¬``, ``®``..``ÿ`` map to
  themselves, the other 68 bytes to U+0100, U+0101, ... in byte order.
- :class:`PreTokenizer` splits text with the regex list chosen by ``tokenizer.ggml.pre``
  (``llm_tokenizer_bpe``). Each regex splits every piece left by the previous one; text between
  two matches is a piece of its own (``unicode_regex_split_stl``). llama.cpp runs some of these
  regexes as hand-written splitters and the others on a category-collapsed copy of the text;
  both are meant to equal the regex, which we run with the ``regex`` module (Unicode
  properties), so results can differ only for code points whose Unicode category differs
  between llama.cpp's tables and the ``regex`` module's, or that llama.cpp's tables leave
  undefined (unassigned code points).
"""
from __future__ import annotations

from dataclasses import dataclass

import regex


def _byte_to_unicode() -> tuple[str, ...]:
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in kept}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return tuple(table[b] for b in range(256))


BYTE_TO_UNICODE: tuple[str, ...] = _byte_to_unicode()
"""GPT-2 byte-level alphabet: ``BYTE_TO_UNICODE[b]`` is the one-character string for byte ``b``."""
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}
_LATIN1_TO_MAPPED = {b: c for b, c in enumerate(BYTE_TO_UNICODE)}


def bytes_to_mapped(data: bytes) -> str:
    """Bytes -> their GPT-2 byte-level string (one character per byte), as stored in BPE vocabs."""
    return data.decode("latin-1").translate(_LATIN1_TO_MAPPED)


def decode_utf8_lossy(data: bytes) -> str:
    """Decode UTF-8 the way llama.cpp's ``unicode_cpts_from_utf8`` does.

    Valid UTF-8 decodes normally. Otherwise each byte that does not begin a structurally complete
    sequence (lead byte plus the right number of continuation bytes) becomes one U+FFFD, and
    decoding resumes at the next byte; so ``b"\\xe6\\xad"`` gives two U+FFFD, where Python's
    ``errors="replace"`` gives one. Like llama.cpp, overlong forms and surrogates are accepted
    as the code point they spell (kept as lone surrogates in the str); a sequence that spells a
    code point above U+10FFFF (on which llama.cpp throws) becomes one U+FFFD.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    out = []
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        if b < 0x80:
            out.append(chr(b))
            i += 1
            continue
        length = 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF8 else 0
        if length == 0 or i + length > n or any(data[i + k] & 0xC0 != 0x80 for k in range(1, length)):
            out.append("\ufffd")
            i += 1
            continue
        cpt = b & (0x7F >> length)
        for k in range(1, length):
            cpt = (cpt << 6) | (data[i + k] & 0x3F)
        out.append(chr(cpt) if cpt <= 0x10FFFF else "\ufffd")
        i += length
    return "".join(out)


# regexes as llama.cpp's llm_tokenizer_bpe writes them (case-insensitive contractions spelled out)
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
REGEX_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
REGEX_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
REGEX_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
REGEXES_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", REGEX_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizerSpec:
    """What a ``tokenizer.ggml.pre`` value selects in llama.cpp's ``llama_vocab::impl::load``.

    ``clean_spaces``: detokenizing removes spaces before ``?!.,`` and some contractions.
    ``ignore_merges``: a pre-token that is itself a vocab token is emitted whole.
    ``add_bos``: default for ``add_bos`` when ``tokenizer.ggml.add_bos_token`` is absent.
    """

    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False


_DEFAULT = PreTokenizerSpec(REGEXES_DEFAULT)
_GPT2 = PreTokenizerSpec((REGEX_GPT2,))
_LLAMA3 = PreTokenizerSpec((REGEX_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizerSpec((REGEX_QWEN2,), clean_spaces=False)

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizerSpec((REGEX_LLAMA3,))),
    # "gpt2" is not a value llama.cpp knows (it writes "gpt-2"), but it names the same thing
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "gigachat", "a.x-4.0", "mellum", "exaone4", "mpt", "olmo"), _GPT2),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), _QWEN2),
    **dict.fromkeys(("megrez", "stablelm2"), PreTokenizerSpec((REGEX_QWEN2,))),
    # LLAMA_VOCAB_PRE_TYPE_SMOLLM: every digit alone, then GPT-2's split
    "smollm": PreTokenizerSpec((r"\p{N}", REGEX_GPT2), clean_spaces=False),
}
"""``tokenizer.ggml.pre`` value -> spec, for the pre-tokenizers edge supports (a subset of llama.cpp's)."""


class PreTokenizer:
    """Splits text into pre-tokens with a list of regexes (llama.cpp ``unicode_regex_split``).

    Args:
        regexes: patterns applied in order; each one splits every piece the previous left.
    """

    def __init__(self, regexes: tuple[str, ...]):
        self.patterns = tuple(regex.compile(r) for r in regexes)

    def split(self, text: str) -> list[str]:
        """The pre-tokens of ``text``, in order; their concatenation is ``text``."""
        spans = [(0, len(text))] if text else []
        for pattern in self.patterns:
            pieces = []
            for start, end in spans:
                pos = start
                for m in pattern.finditer(text, start, end):
                    s, e = m.span()
                    if s > pos:
                        pieces.append((pos, s))
                    pieces.append((s, e))
                    pos = e
                if pos < end:
                    pieces.append((pos, end))
            spans = pieces
        return [text[s:e] for s, e in spans]
