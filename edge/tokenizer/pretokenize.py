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


_CATEGORY = regex.compile(r"\\p\{(?:N|L|P|M|S|Lu|Ll|Lt|Lm|Lo)\}")
_LETTER_SUBCATEGORY = regex.compile(r"\\p\{L[ultmo]\}")


def llama_regex_to_python(expr: str) -> str:
    """A regex of llama.cpp's ``regex_exprs`` -> the ``regex``-module pattern that splits alike.

    llama.cpp (``unicode_regex_split``) runs a pattern that names Unicode categories with
    ``std::regex`` (ECMAScript) on a copy of the text in which every non-ASCII code point is
    replaced by one byte standing for its category; ``\\p{Lu}``, ``\\p{Ll}``, ``\\p{Lt}``,
    ``\\p{Lm}`` and ``\\p{Lo}`` all stand for that one "letter" byte plus ``A-Za-z``, so each
    of them means any letter (``\\p{L}``). ECMAScript's ``\\d`` is ``[0-9]`` and its ``$``
    matches only at the end of the piece, where Python's ``$`` also matches before a final
    newline. ``\\s`` needs no change: llama.cpp's whitespace set equals the ``regex`` module's.
    """
    if _CATEGORY.search(expr):
        expr = _LETTER_SUBCATEGORY.sub(r"\\p{L}", expr)
    out, i, inside = [], 0, False
    while i < len(expr):
        ch = expr[i]
        if ch == "\\" and i + 1 < len(expr):
            pair = expr[i:i + 2]
            out.append("[0-9]" if pair == r"\d" and not inside else "0-9" if pair == r"\d" else pair)
            i += 2
            continue
        if ch == "[" and not inside:
            inside = True
        elif ch == "]" and inside:
            inside = False
        elif ch == "$" and not inside:
            ch = r"\Z"
        out.append(ch)
        i += 1
    return "".join(out)


def _split_digit_groups(text: str, start: int, end: int, out: list[tuple[int, int]]) -> None:
    """llama.cpp ``unicode_regex_split_custom_afmoe``: each run of digits (``\\p{N}``) is cut
    into a leading group of ``len % 3`` digits (if any) and then groups of three. The text
    before a run is not a piece of its own: it joins the run's first group (as in llama.cpp)."""
    prev = start
    for m in _DIGITS.finditer(text, start, end):
        s, e = m.span()
        cut = s + (e - s) % 3
        if cut == s:
            cut += 3
        while cut <= e:
            out.append((prev, cut))
            prev, cut = cut, cut + 3
    if prev < end:
        out.append((prev, end))


_DIGITS = regex.compile(r"\p{N}+")
# llama.cpp unicode_regex_split_custom: patterns run by a hand-written splitter instead
_CUSTOM_SPLITTERS = {
    r"\p{AFMoE_digits}": _split_digit_groups,
    r"\d{1,3}(?=(?:\d{3})*\b)": _split_digit_groups,   # tiny_aya: llama.cpp uses the same splitter
}


class PreTokenizer:
    """Splits text into pre-tokens with a list of regexes (llama.cpp ``unicode_regex_split``).

    Args:
        regexes: patterns as llama.cpp writes them, applied in order; each one splits every
            piece the previous left. Text between two matches is a piece of its own
            (``unicode_regex_split_stl``); empty pieces (zero-width matches) are dropped, as
            they give no tokens.
    """

    def __init__(self, regexes: tuple[str, ...]):
        self.steps = tuple(_CUSTOM_SPLITTERS.get(r) or regex.compile(llama_regex_to_python(r)).finditer
                           for r in regexes)

    def split(self, text: str) -> list[str]:
        """The pre-tokens of ``text``, in order; their concatenation is ``text``."""
        spans = [(0, len(text))] if text else []
        for step in self.steps:
            pieces: list[tuple[int, int]] = []
            for start, end in spans:
                if step is _split_digit_groups:
                    step(text, start, end, pieces)
                    continue
                pos = start
                for m in step(text, start, end):
                    s, e = m.span()
                    if s > pos:
                        pieces.append((pos, s))
                    pieces.append((s, e))
                    pos = e
                if pos < end:
                    pieces.append((pos, end))
            spans = pieces
        return [text[s:e] for s, e in spans if e > s]
