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
  both equal the regex (read with :func:`llama_regex_to_python`), which we run with the
  ``regex`` module. Its Unicode is newer than llama.cpp's tables: the code points assigned
  since (:data:`NEWER_THAN_LLAMA_CPP`) are undefined for llama.cpp, so wherever llama.cpp goes
  by categories we match a copy of the text in which they are a noncharacter
  (:func:`llama_cpp_categories`); there the ``regex`` module's categories equal llama.cpp's
  for every code point (tests/test_tokenizer_vocabs.py checks all of them).
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


NEWER_THAN_LLAMA_CPP: tuple[tuple[int, int], ...] = (
    (0x00558, 0x00558), (0x0058B, 0x0058C), (0x005C8, 0x005C9), (0x0088F, 0x0088F), (0x00897, 0x00897),
    (0x00B53, 0x00B54), (0x00C5C, 0x00C5C), (0x00CDC, 0x00CDC), (0x01ACF, 0x01AF0), (0x01B4E, 0x01B4F),
    (0x01B7F, 0x01B7F), (0x01C89, 0x01C8A), (0x0208F, 0x0208F), (0x0209D, 0x0209F), (0x020C1, 0x020C4),
    (0x02427, 0x02429), (0x02B96, 0x02B96), (0x02E60, 0x02E63), (0x031E4, 0x031E5), (0x0A7CB, 0x0A7CF),
    (0x0A7D2, 0x0A7D2), (0x0A7D4, 0x0A7D4), (0x0A7DA, 0x0A7DD), (0x0A7E2, 0x0A7E2), (0x0A7F1, 0x0A7F1),
    (0x0AB6C, 0x0AB6D), (0x0FBC3, 0x0FBD2), (0x0FD90, 0x0FD91), (0x0FDC8, 0x0FDCE), (0x105C0, 0x105F3),
    (0x107BB, 0x107BF), (0x10940, 0x10959), (0x10D40, 0x10D65), (0x10D69, 0x10D85), (0x10D8E, 0x10D8F),
    (0x10EC2, 0x10EC7), (0x10EC9, 0x10EEE), (0x10EF0, 0x10EFC), (0x11380, 0x11389), (0x1138B, 0x1138B),
    (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113C0), (0x113C2, 0x113C2), (0x113C5, 0x113C5),
    (0x113C7, 0x113CA), (0x113CC, 0x113D5), (0x113D7, 0x113D8), (0x113E1, 0x113E2), (0x116D0, 0x116E3),
    (0x11B0A, 0x11B0A), (0x11B60, 0x11B67), (0x11BC0, 0x11BE1), (0x11BF0, 0x11BF9), (0x11DB0, 0x11DDB),
    (0x11DE0, 0x11DE9), (0x11DF0, 0x11DF1), (0x11F5A, 0x11F5A), (0x1246F, 0x1246F), (0x12475, 0x1247F),
    (0x12550, 0x12686), (0x13460, 0x143FA), (0x16100, 0x16139), (0x16D40, 0x16D79), (0x16EA0, 0x16EB8),
    (0x16EBB, 0x16ED3), (0x16FF2, 0x16FF6), (0x187F8, 0x187FF), (0x18CD6, 0x18CDA), (0x18CFF, 0x18CFF),
    (0x18D09, 0x18D20), (0x18D80, 0x18DF2), (0x18E00, 0x19191), (0x191A0, 0x191D2), (0x1B123, 0x1B128),
    (0x1B168, 0x1B168), (0x1CC00, 0x1CCFC), (0x1CD00, 0x1CEB3), (0x1CEBA, 0x1CED0), (0x1CED2, 0x1CED4),
    (0x1CEDD, 0x1CEFD), (0x1D127, 0x1D128), (0x1D1EB, 0x1D1FF), (0x1D250, 0x1D281), (0x1D6A6, 0x1D6A6),
    (0x1DB00, 0x1DB1C), (0x1DF1F, 0x1DF24), (0x1DF2B, 0x1DF81), (0x1DF90, 0x1DF96), (0x1DFCD, 0x1DFFF),
    (0x1E5D0, 0x1E5FA), (0x1E5FF, 0x1E5FF), (0x1E6C0, 0x1E6DE), (0x1E6E0, 0x1E6F5), (0x1E6FE, 0x1E6FF),
    (0x1F1AE, 0x1F1AE), (0x1F6D8, 0x1F6D9), (0x1F777, 0x1F77A), (0x1F7DA, 0x1F7DB), (0x1F7F1, 0x1F7FF),
    (0x1F8B2, 0x1F8BB), (0x1F8C0, 0x1F8C1), (0x1F8D0, 0x1F8D8), (0x1FA54, 0x1FA57), (0x1FA89, 0x1FA8F),
    (0x1FABE, 0x1FABE), (0x1FAC6, 0x1FAC6), (0x1FAC8, 0x1FAC8), (0x1FACC, 0x1FACD), (0x1FADC, 0x1FADD),
    (0x1FADF, 0x1FADF), (0x1FAE9, 0x1FAEB), (0x1FAEF, 0x1FAEF), (0x1FAF9, 0x1FAFA), (0x1FBCB, 0x1FBEF),
    (0x1FBFA, 0x1FBFA), (0x2B73A, 0x2B73F), (0x2B81E, 0x2B81E), (0x2CEA2, 0x2CEAD), (0x323B0, 0x33479),
    (0x3D000, 0x3FC3F),
)
"""Inclusive code point ranges that the ``regex`` module assigns (Unicode 16 and 17) and
llama.cpp 0.3.36's tables (src/unicode-data.cpp) leave undefined."""
_NEWER = regex.compile("[" + "".join(f"{chr(a)}-{chr(b)}" for a, b in NEWER_THAN_LLAMA_CPP) + "]")
_UNDEFINED = "\ufdd0"  # a noncharacter: unassigned for llama.cpp and for every Unicode version
_AS_UNDEFINED = {c: _UNDEFINED for a, b in NEWER_THAN_LLAMA_CPP for c in range(a, b + 1)}


def llama_cpp_categories(text: str) -> str:
    """``text`` with each code point of :data:`NEWER_THAN_LLAMA_CPP` replaced by U+FDD0: the
    same length, and the same Unicode categories for the ``regex`` module as llama.cpp's
    ``unicode_cpt_flags_from_cpt`` gives the original."""
    return text.translate(_AS_UNDEFINED) if _NEWER.search(text) else text


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


def _split_digit_groups(text: str, probe: str, start: int, end: int, out: list[tuple[int, int]]) -> None:
    """llama.cpp ``unicode_regex_split_custom_afmoe``: each run of digits (``\\p{N}``) is cut
    into a leading group of ``len % 3`` digits (if any) and then groups of three. The text
    before a run is not a piece of its own: it joins the run's first group (as in llama.cpp)."""
    prev = start
    for m in _DIGITS.finditer(probe, start, end):
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
_LETTER = regex.compile(r"\p{L}")
_NUMBER = regex.compile(r"\p{N}")
_SPACE = regex.compile(r"\s")


def _is_han(ch: str) -> bool:
    """llama.cpp ``unicode_cpt_is_han``: the CJK ideograph blocks (unified, extensions A-F,
    compatibility)."""
    c = ord(ch)
    return (0x4E00 <= c <= 0x9FFF or 0x3400 <= c <= 0x4DBF or 0x20000 <= c <= 0x2A6DF or 0x2A700 <= c <= 0x2EBEF
            or 0xF900 <= c <= 0xFAFF or 0x2F800 <= c <= 0x2FA1F)


def _split_kimi_k2(text: str, probe: str, start: int, end: int, out: list[tuple[int, int]]) -> None:
    """llama.cpp ``unicode_regex_split_custom_kimi_k2``, step for step (it is what llama.cpp
    runs for "kimi-k2", and it differs from the regex it cites: its letters take no marks and
    no case split). Han runs; an optional non-letter, non-digit, non-CR/LF character and then
    non-Han letters, with an optional contraction; up to three digits; `` ?`` and non-space
    non-letter non-digits, then CR/LF; whitespace ending at its last CR/LF; whitespace but
    its last character when more follows; whitespace; else one character."""
    def letter(i: int) -> bool:
        return i < end and bool(_LETTER.match(probe, i)) and not _is_han(text[i])

    def kind(i: int) -> str:   # "" outside the piece, else the first of "s", "l", "n" that applies, or "o"
        if i >= end:
            return ""
        return "s" if _SPACE.match(probe, i) else "l" if _LETTER.match(probe, i) else "n" if _NUMBER.match(probe, i) \
            else "o"

    prev = pos = start
    while pos < end:
        ch, k = text[pos], kind(pos)
        if _is_han(ch):
            while pos < end and _is_han(text[pos]):
                pos += 1
        elif letter(pos) or (ch not in "\r\n" and k not in "ln" and letter(pos + 1)):
            if not letter(pos):
                pos += 1
            while letter(pos):
                pos += 1
            if pos + 1 < end and text[pos] == "'":
                nxt = _lower_ascii(text[pos + 1])
                if nxt in "stmd":
                    pos += 2
                elif pos + 2 < end and nxt + _lower_ascii(text[pos + 2]) in ("re", "ve", "ll"):
                    pos += 3
        elif k == "n":
            run = pos
            while kind(pos) == "n":
                pos += 1
                if pos - run >= 3:
                    out.append((prev, pos))
                    prev = run = pos
        elif (kind(pos + 1) if ch == " " else k) == "o":
            pos += ch == " "
            while kind(pos) == "o":
                pos += 1
            while pos < end and text[pos] in "\r\n":
                pos += 1
        else:
            n, last_newline = 0, 0
            while kind(pos + n) == "s":
                if text[pos + n] in "\r\n":
                    last_newline = pos + n + 1
                n += 1
            if last_newline:
                pos = last_newline
            elif n > 1 and pos + n < end:
                pos += n - 1
            else:
                pos += max(n, 1)
        if pos > prev:
            out.append((prev, pos))
        prev = pos


def _lower_ascii(ch: str) -> str:
    """llama.cpp ``unicode_tolower`` of one character (first code point of the lowercase)."""
    low = ch.lower()
    return low[0] if low else ch
# llama.cpp unicode_regex_split_custom: patterns run by a hand-written splitter instead
_CUSTOM_SPLITTERS = {
    r"\p{AFMoE_digits}": _split_digit_groups,
    r"\d{1,3}(?=(?:\d{3})*\b)": _split_digit_groups,   # tiny_aya: llama.cpp uses the same splitter
    r"\p{Han}+": _split_kimi_k2,
}


_SPLITTERS = frozenset(_CUSTOM_SPLITTERS.values())


class PreTokenizer:
    """Splits text into pre-tokens with a list of regexes (llama.cpp ``unicode_regex_split``).

    Args:
        regexes: patterns as llama.cpp writes them, applied in order; each one splits every
            piece the previous left. Text between two matches is a piece of its own
            (``unicode_regex_split_stl``); empty pieces (zero-width matches) are dropped, as
            they give no tokens.
    """

    def __init__(self, regexes: tuple[str, ...]):
        # (splitter, whether it goes by Unicode categories: llama.cpp's custom splitters and
        # "collapsed" regexes do; a regex without \p{..} runs on the code points themselves)
        self.steps = tuple((_CUSTOM_SPLITTERS[r], True) if r in _CUSTOM_SPLITTERS else
                           (regex.compile(llama_regex_to_python(r)).finditer, bool(_CATEGORY.search(r)))
                           for r in regexes)

    def split(self, text: str) -> list[str]:
        """The pre-tokens of ``text``, in order; their concatenation is ``text``."""
        spans = [(0, len(text))] if text else []
        by_category = llama_cpp_categories(text)
        for step, categories in self.steps:
            probe = by_category if categories else text
            pieces: list[tuple[int, int]] = []
            for start, end in spans:
                if step in _SPLITTERS:
                    step(text, by_category, start, end, pieces)
                    continue
                pos = start
                for m in step(probe, start, end):
                    s, e = m.span()
                    if s > pos:
                        pieces.append((pos, s))
                    pieces.append((s, e))
                    pos = e
                if pos < end:
                    pieces.append((pos, end))
            spans = pieces
        return [text[s:e] for s, e in spans if e > s]
