"""WordPiece (BERT) tokenization, as llama.cpp's ``llm_tokenizer_wpm_session`` does it, and
the whitespace segmentation of its "whitespace" BPE tokenizer."""
from __future__ import annotations

import unicodedata

import regex

from edge.tokenizer.pretokenize import decode_utf8_lossy, llama_cpp_categories

_ESCAPED_SPACE = "\u2581"
_WHITESPACE = regex.compile(r"\s")
_CONTROL = regex.compile(r"[\p{Cc}\p{Cf}\p{Co}\p{Cs}]")   # llama.cpp CONTROL: \p{C} but unassigned
_MARK = regex.compile(r"\p{M}")
_PUNCT = regex.compile(r"\p{P}")
_SYMBOL = regex.compile(r"\p{S}")


def _is_chinese(cpt: int) -> bool:
    """llama.cpp ``llm_tokenizer_wpm_session::is_chinese_char`` (its ranges, one of them
    starting at 0x2B920 as in the Hugging Face code)."""
    return (0x4E00 <= cpt <= 0x9FFF or 0x3400 <= cpt <= 0x4DBF or 0x20000 <= cpt <= 0x2A6DF
            or 0x2A700 <= cpt <= 0x2B73F or 0x2B740 <= cpt <= 0x2B81F or 0x2B920 <= cpt <= 0x2CEAF
            or 0xF900 <= cpt <= 0xFAFF or 0x2F800 <= cpt <= 0x2FA1F)


def _first_nfd(ch: str) -> str:
    """The first code point of ``ch``'s canonical decomposition (llama.cpp's NFD table keeps
    only that one: "é" -> "e")."""
    return unicodedata.normalize("NFD", ch)[0] if not "\ud800" <= ch <= "\udfff" else ch


def _lower(ch: str) -> str:
    """llama.cpp ``unicode_tolower``: one code point, the first of the lowercase mapping."""
    low = ch.lower()
    return low[0] if low else ch


class WPMModel:
    """BERT WordPiece: normalize, split into words, then longest-match-first per word.

    Algorithm (llama.cpp ``llm_tokenizer_wpm_session``): read the text as UTF-8; with
    ``strip_accents`` replace each code point by the first of its NFD decomposition and drop
    marks (\\p{M}); drop NUL, U+FFFD and control code points; lowercase (``lowercase``);
    whitespace ends a word; punctuation, ASCII symbols and CJK ideographs are words of their
    own. Each word, prefixed with U+2581 (how llama.cpp's converter marks word-initial tokens),
    is covered greedily from the left by the longest vocab token at each position; a word
    with a position no token covers becomes the single ``unk_id``.

    Args:
        token_to_id: token text -> id.
        unk_id: the unknown token (``tokenizer.ggml.unknown_token_id``, default 100).
        lowercase, strip_accents: BertNormalizer options.
    """

    def __init__(self, token_to_id: dict[str, int], unk_id: int | None, lowercase: bool, strip_accents: bool):
        self.token_to_id = token_to_id
        self.unk_id = unk_id
        self.lowercase = lowercase
        self.strip_accents = strip_accents
        self.max_len = max(len(t) for t in token_to_id)

    def words(self, text: str) -> list[str]:
        """llama.cpp ``llm_tokenizer_wpm_session::preprocess``: the normalized words of ``text``."""
        words: list[str] = []
        word: list[str] = []
        if self.strip_accents:
            text = "".join(map(_first_nfd, text))
        for ch, probe in zip(text, llama_cpp_categories(text)):   # probe: ch as llama.cpp's tables see it
            if _WHITESPACE.match(probe):
                if word:
                    words.append("".join(word))
                    word = []
                continue
            if ch in "\x00\ufffd" or _CONTROL.match(probe) or self.strip_accents and _MARK.match(probe):
                continue
            out = _lower(ch) if self.lowercase else ch
            if _PUNCT.match(probe) or ord(ch) < 0x7F and _SYMBOL.match(probe) or _is_chinese(ord(ch)):
                if word:
                    words.append("".join(word))
                    word = []
                words.append(out)
            else:
                word.append(out)
        if word:
            words.append("".join(word))
        return words

    def tokenize(self, text: bytes, out: list[int]) -> None:
        """Append the token ids of ``text`` (raw bytes) to ``out``."""
        get, max_len = self.token_to_id.get, self.max_len
        for word in self.words(decode_utf8_lossy(text)):
            word = _ESCAPED_SPACE + word
            n, start = len(word), len(out)
            i = 0
            while i < n:
                for j in range(min(n, i + max_len), i, -1):
                    tid = get(word[i:j])
                    if tid is not None:
                        out.append(tid)
                        i = j
                        break
                else:  # no token covers position i: the whole word is unknown
                    del out[start:]
                    break
            if len(out) == start:
                out.append(self.unk_id)


class WhitespaceSegments:
    """llama.cpp ``llm_tokenizer_whitespace_session``: the text, read as UTF-8, cut at each
    whitespace code point (which is dropped), each code point lowercased when ``lowercase``;
    every segment is then BPE-tokenized on its own."""

    def __init__(self, lowercase: bool):
        self.lowercase = lowercase

    def split(self, text: bytes) -> list[bytes]:
        """The UTF-8 segments of ``text`` (raw bytes), in order, none empty."""
        decoded = decode_utf8_lossy(text)
        probe = llama_cpp_categories(decoded)
        segments, segment = [], []
        for ch, seen in zip(decoded, probe):
            if _WHITESPACE.match(seen):
                if segment:
                    segments.append("".join(segment).encode("utf-8", "surrogatepass"))
                    segment = []
            else:
                segment.append(_lower(ch) if self.lowercase else ch)
        if segment:
            segments.append("".join(segment).encode("utf-8", "surrogatepass"))
        return segments
