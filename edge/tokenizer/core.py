"""The tokenizer: text <-> token ids, agreeing with llama.cpp token for token.

Mirrors llama.cpp ``llama_vocab::impl`` (src/llama-vocab.cpp): ``tokenize`` (special-token
partition, then SPM or BPE per text fragment, BOS/EOS), ``token_to_piece`` and ``detokenize``.
All text out of this module is bytes; turning bytes into str for display is the job of
:class:`edge.tokenizer.stream.StreamDecoder`.
"""
from __future__ import annotations

import bisect
import operator
import re
from collections.abc import Iterable, Sequence

import numpy as np

from edge.gguf_file import GGUFFile
from edge.tokenizer.bpe import BPEModel
from edge.tokenizer.pretokenize import UNICODE_TO_BYTE, PreTokenizer
from edge.tokenizer.spm import SPMModel
from edge.tokenizer.ugm import UGMModel
from edge.tokenizer.vocab import TokenAttr, TokenizerError, Vocab, read_vocab
from edge.tokenizer.wpm import WhitespaceSegments, WPMModel

_ESCAPED_SPACE = "\u2581".encode()  # SentencePiece's visible space, U+2581
# plain ints: attribute tests run per token
_RENDERED_AS_TEXT = int(TokenAttr.UNKNOWN | TokenAttr.CONTROL | TokenAttr.USER_DEFINED)
_SPECIAL = int(TokenAttr.UNKNOWN | TokenAttr.CONTROL)  # rendered only when asked; matched only when parsing
_NORMAL, _BYTE = int(TokenAttr.NORMAL), int(TokenAttr.BYTE)
_LSTRIP, _RSTRIP = int(TokenAttr.LSTRIP), int(TokenAttr.RSTRIP)
_STRIP = _LSTRIP | _RSTRIP
_C_SPACE = b" \t\n\v\f\r"


class Tokenizer:
    """A GGUF model's tokenizer: ``tokenizer.ggml.model`` "llama" (SentencePiece), "gpt2"
    (byte-level BPE), "gemma4" (BPE over text with U+2581 for spaces), "bert" (WordPiece) or
    "t5" (Unigram).

    Build with :meth:`from_gguf`. Token ids are ints in ``[0, n_vocab)``.

    Attributes:
        model: ``tokenizer.ggml.model``.
        kind: llama.cpp's vocab type, "spm", "bpe", "wpm" or "ugm".
        n_vocab: number of tokens.
        bos_id, eos_id, unk_id, pad_id: special token ids, or None.
        add_bos, add_eos: whether ``encode(..., add_special=True)`` adds BOS / EOS.
        add_space_prefix: SPM only: a space is put before text at the start / after a special token.
        eog_ids: end-of-generation token ids (llama.cpp ``special_eog_ids``).
        special_ids: special token ids by field name (bos, eos, eot, eom, unk, pad, sep, mask,
            fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep), None when the model has none
            (the FIM ids from the GGUF keys or llama.cpp's text-based detection).
        token_types: int32[n_vocab], GGUF ``tokenizer.ggml.token_type`` (gguf.TokenType values).
    """

    def __init__(self, vocab: Vocab):
        self.model = vocab.model
        self.kind = vocab.kind
        self._texts = vocab.texts
        self._attrs = vocab.attrs
        self.n_vocab = len(vocab.texts)
        self.token_types = vocab.token_types
        self.bos_id, self.eos_id = vocab.ids["bos"], vocab.ids["eos"]
        self.unk_id, self.pad_id = vocab.ids["unk"], vocab.ids["pad"]
        self.sep_id = vocab.ids["sep"]
        self.add_bos, self.add_eos = vocab.add_bos, vocab.add_eos
        self.add_space_prefix = vocab.add_space_prefix
        self._clean_spaces = vocab.clean_spaces
        self.eog_ids = vocab.eog_ids
        self.special_ids = dict(vocab.ids)
        self._pieces: list[bytes | None] = [None] * self.n_vocab

        # special-token partition candidates, longest text first (llama.cpp cache_special_tokens)
        candidates = np.flatnonzero(np.asarray(self._attrs) & _RENDERED_AS_TEXT).tolist()
        encoded = {i: self._texts[i].encode("utf-8", "surrogateescape") for i in candidates}
        candidates.sort(key=lambda i: (-len(encoded[i]), i))
        self._specials_all = [(i, encoded[i]) for i in candidates]
        self._specials_user = [(i, t) for i, t in self._specials_all if not self._attrs[i] & _SPECIAL]
        self._matchers: dict[bool, _SpecialMatcher] = {}   # by parse_special, built on first use

        token_to_id = vocab.token_to_id
        self._escape_spaces = self.kind in ("spm", "ugm") or bool(vocab.pre and vocab.pre.escape_whitespaces)
        if self.kind == "spm":
            self._spm = SPMModel(token_to_id, vocab.scores, self.unk_id)
        elif self.kind == "ugm":
            self._ugm = UGMModel(vocab.texts, vocab.scores, vocab.attrs, self.unk_id, vocab.charsmap,
                                 vocab.add_space_prefix, vocab.remove_extra_whitespaces)
        elif self.kind == "wpm":
            self._wpm = WPMModel(token_to_id, self.unk_id, vocab.lowercase, vocab.strip_accents)
        else:
            pre = vocab.pre
            self._bpe = BPEModel(token_to_id, vocab.merges, PreTokenizer(pre.regexes), pre.ignore_merges,
                                 pre.byte_encode, pre.newline_tokens)
            # llm_tokenizer_whitespace_session: BPE per whitespace-free segment, lowercased
            self._segments = WhitespaceSegments(vocab.lowercase) if self.model == "whitespace" else None

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Tokenizer:
        """Build the tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

        Raises:
            GGUFError: metadata missing or malformed, naming the key (see :func:`read_vocab`).
        """
        return cls(read_vocab(gf))

    # ------------------------------------------------------------------ token facts
    def token_text(self, token_id: int) -> str:
        """The token's vocab text as stored in the GGUF (byte-level alphabet for BPE, ▁ for SPM)."""
        return self._texts[self._check_id(token_id)]

    def token_attr(self, token_id: int) -> TokenAttr:
        """The token's llama.cpp attributes (after llama.cpp's text-based fix-ups)."""
        return TokenAttr(self._attrs[self._check_id(token_id)])

    def special_texts(self) -> list[str]:
        """The texts that ``parse_special`` matches and ``protect`` guards (control and unknown
        tokens), longest first: text from a user must not reach the prompt as them."""
        texts = getattr(self, "_special_texts", None)
        if texts is None:
            texts = {t.decode("utf-8", "replace") for i, t in self._specials_all if self._attrs[i] & _SPECIAL and t}
            texts = self._special_texts = sorted(texts, key=lambda t: (-len(t), t))
        return list(texts)

    def is_eog(self, token_id: int) -> bool:
        """True if generating this token ends generation (llama.cpp ``llama_vocab_is_eog``)."""
        return token_id in self.eog_ids

    # ------------------------------------------------------------------ encode
    def encode(self, text: str | bytes, add_special: bool, parse_special: bool,
               protect: Sequence[tuple[int, int]] = (), space_prefix: bool = True) -> list[int]:
        """Text -> token ids (llama.cpp ``llama_tokenize``).

        Args:
            text: str (encoded as UTF-8) or raw bytes (need not be valid UTF-8).
            add_special: add BOS / EOS where the model asks for them (``add_bos``/``add_eos``);
                a text that itself starts with BOS then gets two, as in llama.cpp.
            parse_special: match control and unknown tokens (e.g. ``<|im_start|>``) written in
                the text; when False they are tokenized as plain text. USER_DEFINED tokens are
                matched either way. Text from a user must be encoded with False.
            protect: ``(start, end)`` spans of ``text`` (character offsets for str, byte
                offsets for bytes) in which control and unknown tokens are never matched, as if
                ``parse_special`` were False there; a match overlapping a span is not taken.
                The spans do not split the text otherwise, so a chat prompt with its message
                contents protected tokenizes exactly as llama.cpp tokenizes the whole prompt
                whenever the contents hold no special token.
            space_prefix: False: no SentencePiece space prefix at the start (``add_space_prefix``
                models), for text that continues other text (edge.grammar's tokenizer).

        Raises:
            TypeError: ``text`` is neither str nor bytes.
            TokenizerError: a ``protect`` span is not within ``text``.
        """
        if isinstance(text, str):
            raw = text.encode("utf-8", "surrogatepass")
        elif isinstance(text, (bytes, bytearray, memoryview)):
            raw = bytes(text)
        else:
            raise TypeError(f"encode() needs str or bytes, not {type(text).__name__}")
        protected = _byte_spans(text, protect)
        fragments = self._partition(raw, parse_special, protected) if raw else []
        out: list[int] = []
        if self.kind == "wpm":  # llama.cpp: BOS (CLS) and SEP whenever add_special, whatever add_bos says
            if add_special:
                out.append(self.bos_id)
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                else:
                    self._wpm.tokenize(fragment, out)
            if add_special:
                out.append(self.sep_id)
            return out
        if add_special and self.add_bos:
            out.append(self.bos_id)
        if self.kind == "spm":
            self._encode_spm(fragments, out, space_prefix)
        elif self.kind == "ugm":
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                else:
                    self._ugm.tokenize(fragment, out)
        else:
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                elif self._segments is not None:
                    for segment in self._segments.split(fragment):
                        self._bpe.tokenize(segment, out)
                else:
                    self._bpe.tokenize(fragment.replace(b" ", _ESCAPED_SPACE) if self._escape_spaces else fragment,
                                       out)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _encode_spm(self, fragments: list[bytes | int], out: list[int], space_prefix: bool = True) -> None:
        prev_special = space_prefix  # a space prefix goes at the start and after each special token
        for fragment in fragments:
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                fragment = b" " + fragment
            self._spm.tokenize(fragment.replace(b" ", _ESCAPED_SPACE), out)
            prev_special = False

    def _partition(self, raw: bytes, parse_special: bool, protected: list[tuple[int, int]]) -> list[bytes | int]:
        """Split ``raw`` into text fragments and special token ids (``tokenizer_st_partition``).

        Special tokens are tried longest first; each splits every remaining text fragment at all
        its non-overlapping occurrences, left to right (skipping, for control and unknown
        tokens, occurrences that overlap a ``protected`` byte span). Equivalently, and so
        computed here: in that order of tokens and, per token, of positions, an occurrence is
        taken when none of its bytes is taken yet and it overlaps no guarding span. One regex
        pass finds every occurrence of every candidate token, so the work grows with the text
        and the number of occurrences, not with their product or with the vocabulary.
        A token with LSTRIP (RSTRIP) removes the ASCII whitespace (C ``isspace``) right before
        (after) an occurrence it takes, up to the fragment's edge.
        """
        specials = self._specials_all if parse_special else self._specials_user
        matcher = self._matchers.get(parse_special)
        if matcher is None:
            matcher = self._matchers[parse_special] = _SpecialMatcher(specials)
        occurrences = matcher.occurrences(raw)
        if not occurrences:
            return [raw]
        guard = _SpanGuard(protected)
        taken = bytearray(len(raw))
        found: list[tuple[int, int, int]] = []
        for rank in sorted(occurrences):
            tid, token = specials[rank]
            n = len(token)
            guarded = bool(self._attrs[tid] & _SPECIAL) and bool(guard)
            mark = b"\x01" * n
            for j in occurrences[rank]:
                k = j + n
                if taken.find(1, j, k) >= 0 or (guarded and guard.overlaps(j, k)):
                    continue
                taken[j:k] = mark
                found.append((j, k, tid))
                strip = self._attrs[tid] & _STRIP
                if strip & _LSTRIP:
                    i = j
                    while i > 0 and not taken[i - 1] and raw[i - 1] in _C_SPACE:
                        i -= 1
                    taken[i:j] = b"\x01" * (j - i)
                    found.append((i, j, -1))
                if strip & _RSTRIP:
                    i = k
                    while i < len(raw) and not taken[i] and raw[i] in _C_SPACE:
                        i += 1
                    taken[k:i] = b"\x01" * (i - k)
                    found.append((k, i, -1))
        found.sort()
        out: list[bytes | int] = []
        pos = 0
        for j, k, tid in found:
            if j > pos:
                out.append(raw[pos:j])
            if tid >= 0:
                out.append(tid)
            pos = max(pos, k)
        if pos < len(raw):
            out.append(raw[pos:])
        return out

    # ------------------------------------------------------------------ decode
    def token_to_piece(self, token_id: int, special: bool = False) -> bytes:
        """One token's bytes (llama.cpp ``llama_token_to_piece`` with lstrip 0).

        SPM: ▁ becomes a space, byte tokens ``<0xXX>`` their byte. BPE: the byte-level alphabet
        maps back to bytes. Control and unknown tokens give their text only when ``special``,
        else b""; user-defined tokens always give their text; unused tokens give b"".

        Raises:
            TokenizerError: ``token_id`` is outside ``[0, n_vocab)``.
        """
        tid = self._check_id(token_id)
        if not special and self._attrs[tid] & _SPECIAL:
            return b""
        piece = self._pieces[tid]
        if piece is None:
            piece = self._pieces[tid] = self._piece(tid)
        return piece

    def _piece(self, tid: int) -> bytes:
        attr, text = self._attrs[tid], self._texts[tid]
        raw = text.encode("utf-8", "surrogateescape")
        if attr & _RENDERED_AS_TEXT:
            return raw
        if attr & _NORMAL:
            if self._escape_spaces or self.kind == "wpm":
                return raw.replace(_ESCAPED_SPACE, b" ")
            return _byte_level_to_bytes(text)
        if attr & _BYTE:
            return bytes([_hex_prefix_value(text[3:5]) & 0xFF])
        return b""  # UNUSED, UNDEFINED

    def decode(self, ids: Iterable[int], remove_special: bool = False, unparse_special: bool = False) -> bytes:
        """Token ids -> bytes (llama.cpp ``llama_detokenize``). Never returns str.

        Args:
            ids: token ids.
            remove_special: drop a leading BOS (when ``add_bos``) and a trailing EOS (when ``add_eos``).
            unparse_special: render control and unknown tokens as their text.

        With ``add_space_prefix`` the first token's leading space is dropped (unless a BOS was
        removed). Tokenizers with llama.cpp's ``clean_spaces`` (BPE "default", "gpt-2", llama 3)
        then drop the space before ``? ! . ,``, around a lone ``'`` and before ``'s 'm 're 've``.
        The bytes may end inside a UTF-8 character; see :class:`StreamDecoder`.

        Raises:
            TokenizerError: an id is outside ``[0, n_vocab)``.
        """
        ids = list(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids = ids[1:]
            remove_space = False
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        pieces = [self.token_to_piece(t, unparse_special) for t in ids]
        if remove_space and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces)
        return _clean_spaces(text) if self._clean_spaces else text

    def _check_id(self, token_id: int) -> int:
        tid = operator.index(token_id)
        if not 0 <= tid < self.n_vocab:
            raise TokenizerError(f"token id {tid} is outside the vocab of {self.n_vocab} tokens")
        return tid

    def __repr__(self) -> str:
        return f"Tokenizer({self.model!r}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"


def _byte_spans(text: str | bytes, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` spans of ``text`` -> spans of its UTF-8 bytes (one pass over the text)."""
    for start, end in spans:
        if not 0 <= start <= end <= len(text):
            raise TokenizerError(f"protect span ({start}, {end}) is not within the text of length {len(text)}")
    if isinstance(text, bytes) or text.isascii():
        return [(s, e) for s, e in spans]
    offsets, prev, n = {0: 0}, 0, 0
    for i in sorted({i for span in spans for i in span}):
        n += len(text[prev:i].encode("utf-8", "surrogatepass"))
        offsets[i], prev = n, i
    return [(offsets[s], offsets[e]) for s, e in spans]


class _SpanGuard:
    """Whether a byte range overlaps any of a set of spans, in O(log n) per question."""

    def __init__(self, spans: Sequence[tuple[int, int]]):
        spans = sorted(spans)
        self._starts = [s for s, _ in spans]
        self._max_end, m = [], -1       # the largest end among the spans starting at or before each
        for _, e in spans:
            m = max(m, e)
            self._max_end.append(m)

    def __bool__(self) -> bool:
        return bool(self._starts)

    def overlaps(self, j: int, k: int) -> bool:
        """True if some span (s, e) has s < k and j < e (an empty span strictly inside counts)."""
        i = bisect.bisect_left(self._starts, k)
        return i > 0 and self._max_end[i - 1] > j


class _SpecialMatcher:
    """Every occurrence of every token of a priority-ordered list of ``(id, bytes)``, found
    with one regex: a trie of the token texts in a lookahead, which gives at each position
    the longest token starting there; the shorter ones starting there are its prefixes that
    are tokens, known in advance."""

    def __init__(self, specials: list[tuple[int, bytes]]):
        rank = {text: r for r, (_, text) in enumerate(specials)}
        lengths = sorted({len(t) for t in rank})
        self._prefixes = {text: [rank[text[:n]] for n in lengths if n <= len(text) and text[:n] in rank]
                          for text in rank}
        self._regex = None
        if rank:
            try:
                self._regex = re.compile(b"(?=(" + _trie_pattern(list(rank)) + b"))")
            except (RecursionError, re.error, OverflowError):   # a vocabulary no regex can hold
                self._regex = None
        self._texts = [t for _, t in specials] if rank and self._regex is None else None

    def occurrences(self, raw: bytes) -> dict[int, list[int]]:
        """{token rank: its start positions in ``raw``, ascending}, overlapping ones included."""
        out: dict[int, list[int]] = {}
        if self._texts is not None:          # the slow path: one scan per token
            for r, token in enumerate(self._texts):
                j = raw.find(token)
                while j >= 0:
                    out.setdefault(r, []).append(j)
                    j = raw.find(token, j + 1)
            return out
        if self._regex is None:
            return out
        prefixes = self._prefixes
        for m in self._regex.finditer(raw):
            j = m.start()
            for r in prefixes[m.group(1)]:
                out.setdefault(r, []).append(j)
        return out


def _trie_pattern(texts: list[bytes]) -> bytes:
    """A regex (bytes) matching any of ``texts``, the longest where several match: the texts'
    trie, with runs of single children as one literal."""
    trie: dict = {}
    for t in texts:
        node = trie
        for b in t:
            node = node.setdefault(b, {})
        node[None] = True

    def pattern(node: dict) -> bytes:
        alts = []
        for b, child in node.items():
            if b is None:
                continue
            run = bytearray([b])
            while len(child) == 1 and None not in child:
                (b2, child), = child.items()
                run.append(b2)
            alts.append(re.escape(bytes(run)) + pattern(child))
        if not alts:
            return b""
        group = alts[0] if len(alts) == 1 else b"(?:" + b"|".join(alts) + b")"
        if None in node:
            return b"(?:" + group + b")?"
        return group if len(alts) == 1 else group

    return pattern(trie)


def _byte_level_to_bytes(text: str) -> bytes:
    """A BPE token's byte-level text -> bytes (llama.cpp ``llama_decode_text``): a character
    outside the byte-level alphabet becomes ``[UNK_BYTE_0x<its utf-8 hex><text>]`` as there."""
    out = bytearray()
    for ch in text:
        b = UNICODE_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            utf8 = ch.encode("utf-8", "surrogateescape")
            out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8", "surrogateescape") + b"]"
    return bytes(out)


def _hex_prefix_value(s: str) -> int:
    """Value of the leading hex digits of ``s`` (0 if none), like ``strtol(s, NULL, 16)``."""
    digits = ""
    for ch in s:
        if ch not in "0123456789abcdefABCDEF":
            break
        digits += ch
    return int(digits, 16) if digits else 0


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp ``detokenize``'s three ``clean_spaces`` passes, byte for byte."""
    space, quote = 0x20, 0x27
    # 1: " ?" " !" " ." " ," lose the space
    out = bytearray(text[:1])
    for i in range(1, len(text)):
        if text[i - 1] == space and text[i] in b"?!.,":
            out.pop()
        out.append(text[i])
    # 2: " ' " -> "'" (the removed right space no longer counts as a space for the next byte)
    t, out = bytearray(out), bytearray(out[:1])
    i = 1
    while i < len(t):
        x = t[i]
        if x == quote and i + 1 < len(t) and t[i - 1] == space and t[i + 1] == space:
            out.pop()
            i += 1
            t[i] = 0
        out.append(x)
        i += 1
    # 3: " 's" " 'm" " 're" " 've" lose the space (" 't" " 'd" " 'll" keep it)
    t, out = bytes(out), bytearray(out[:1])
    for i in range(1, len(t)):
        x = t[i]
        if t[i - 1] == space and x == quote and i + 1 < len(t):
            x1 = t[i + 1]
            if x1 in b"sm":
                out.pop()
            elif x1 not in b"td" and i + 2 < len(t) and (x1, t[i + 2]) in ((0x72, 0x65), (0x76, 0x65)):
                out.pop()
        out.append(x)
    return bytes(out)
