"""Unigram (T5-style SentencePiece) tokenization, as llama.cpp's ``llm_tokenizer_ugm_session``
does it: normalization by the model's precompiled character map, then Viterbi over token scores."""
from __future__ import annotations

import struct

from edge.tokenizer.vocab import TokenAttr, TokenizerError

_ESCAPED_SPACE = "\u2581".encode()
_UTF8_LEN = (1,) * 12 + (2, 2, 3, 4)   # by lead byte >> 4 (llama.cpp unicode_len_utf8)


class CharsMap:
    """SentencePiece's ``precompiled_charsmap``: a XOR-compressed double array (XCDA) trie of
    byte strings, each leading to a NUL-terminated replacement.

    Layout (``llm_tokenizer_ugm``'s constructor): u32 LE blob size, then that many bytes of u32
    LE entries, then the replacement strings. An entry packs BASE in bits 10-30 (shifted left
    by 8 when bit 9 is set), LCHECK in bits 0-7 (and bit 31), LEAF in bit 8, and, for a leaf's
    child, the replacement offset in bits 0-30.

    Raises:
        TokenizerError: the map is truncated or an index points outside it.
    """

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise TokenizerError("precompiled_charsmap is too small for its size header")
        (size,) = struct.unpack_from("<I", blob)
        if size + 4 >= len(blob):
            raise TokenizerError("precompiled_charsmap: XCDA size points outside the map")
        self.nodes = struct.unpack_from(f"<{size // 4}I", blob, 4)
        self.replacements = blob[4 + size:]

    def _node(self, i: int) -> int:
        if i >= len(self.nodes):
            raise TokenizerError("precompiled_charsmap: index outside the XCDA array")
        return self.nodes[i]

    def _base(self, i: int) -> int:
        node = self._node(i)
        return (node >> 10) << ((node & (1 << 9)) >> 6)

    def longest_prefix(self, data: bytes, start: int) -> tuple[int, bytes]:
        """(length, replacement) of the longest key that ``data[start:]`` starts with; (0, b"")
        if none (llama.cpp ``normalize_prefix``'s XCDA walk; a NUL byte ends the key)."""
        best_len, best_off = 0, 0
        index = self._base(0)
        for pos in range(start, len(data)):
            c = data[pos]
            if c == 0:
                break
            index ^= c
            node = self._node(index)
            if node & ((1 << 31) | 0xFF) != c:
                break
            leaf = (node >> 8) & 1
            index ^= self._base(index)
            if leaf:
                best_len, best_off = pos - start + 1, self._node(index) & ((1 << 31) - 1)
        if best_len == 0:
            return 0, b""
        end = self.replacements.find(b"\0", best_off)
        if best_off >= len(self.replacements) or end < 0:
            raise TokenizerError("precompiled_charsmap: replacement outside the map or unterminated")
        return best_len, self.replacements[best_off:end]


class UGMModel:
    """Unigram language model tokenizer (llama.cpp ``llm_tokenizer_ugm_session``).

    Normalize (:meth:`normalize`), then at each code point of the normalized bytes extend every
    token that starts there (NORMAL, USER_DEFINED and UNUSED tokens; user-defined ones score 0)
    and keep, per end position, the best score sum (strictly better replaces, so the earlier
    start wins ties); a code point that no single-code-point token covers may be the unknown
    token at ``min(NORMAL scores) - 10``. Backtrack from the end; consecutive unknown tokens
    are emitted once.

    Args:
        texts: token texts as stored (utf-8 with surrogateescape), indexed by id.
        scores: token scores; attrs: llama.cpp attribute bits per token.
        unk_id: the unknown token.
        charsmap: ``tokenizer.ggml.precompiled_charsmap`` bytes, or None.
        add_space_prefix, remove_extra_whitespaces, escape_whitespaces: llama.cpp's flags.
    """

    def __init__(self, texts: list[str], scores: list[float], attrs: list[int], unk_id: int,
                 charsmap: bytes | None, add_space_prefix: bool, remove_extra_whitespaces: bool,
                 escape_whitespaces: bool = True):
        normal, user, unused = int(TokenAttr.NORMAL), int(TokenAttr.USER_DEFINED), int(TokenAttr.UNUSED)
        self.tokens: dict[bytes, int] = {}
        self.user_prefixes: set[bytes] = set()
        min_score = float("inf")
        for tid, (text, attr) in enumerate(zip(texts, attrs)):
            raw = text.encode("utf-8", "surrogateescape")
            if attr & normal:
                min_score = min(min_score, scores[tid])
            if attr & (normal | user | unused):
                self.tokens[raw] = tid
            if attr & user:
                self.user_prefixes.update(raw[:n] for n in range(1, len(raw) + 1))
        self.scores = [0.0 if a & user else s for s, a in zip(scores, attrs)]
        self.unk_score = (min_score if min_score != float("inf") else 3.4028234663852886e38) - 10.0
        self.max_len = max(map(len, self.tokens), default=0)
        self.max_user = max(map(len, self.user_prefixes), default=0)
        self.unk_id = unk_id
        self.charsmap = CharsMap(charsmap) if charsmap else None
        self.prepend = add_space_prefix
        self.merge = remove_extra_whitespaces
        self.space = _ESCAPED_SPACE if escape_whitespaces else b" "

    def _normalize_prefix(self, data: bytes, pos: int) -> tuple[bytes, int]:
        """(normalized bytes, bytes consumed) at ``pos`` (llama.cpp ``normalize_prefix``)."""
        for n in range(min(self.max_user, len(data) - pos), 0, -1):   # deepest user-defined trie node
            if data[pos:pos + n] in self.user_prefixes:
                return data[pos:pos + n], n
        if self.charsmap is not None:
            n, replacement = self.charsmap.longest_prefix(data, pos)
            if n:
                return replacement, n
        b = data[pos]
        n = 1 if b < 0x80 else 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 0
        if n == 0 or pos + n > len(data) or any(data[pos + k] & 0xC0 != 0x80 for k in range(1, n)):
            return "\ufffd".encode(), 1
        return data[pos:pos + n], n

    def normalize(self, data: bytes) -> bytes:
        """llama.cpp ``llm_tokenizer_ugm_session::normalize``: charsmap, spaces as U+2581, a
        space before the first word (``add_space_prefix``) or before every word with runs of
        spaces dropped (``remove_extra_whitespaces``)."""
        out = bytearray()
        prepended = in_word = False
        pos = 0
        while pos < len(data):
            chunk, used = self._normalize_prefix(data, pos)
            for c in chunk:
                if c != 0x20:
                    if not in_word:
                        in_word = True
                        if (self.prepend and not prepended) or self.merge:
                            out += self.space
                            prepended = True
                    out.append(c)
                else:
                    in_word = False
                    if not self.merge:
                        out += self.space
            pos += used
        return bytes(out)

    def tokenize(self, text: bytes, out: list[int]) -> None:
        """Append the token ids of ``text`` (raw bytes) to ``out``."""
        norm = self.normalize(text)
        n = len(norm)
        if n == 0:
            return
        best = [(-float("inf"), 0, self.unk_id)] * (n + 1)   # (score sum, start, token) per end
        best[0] = (0.0, 0, self.unk_id)
        tokens, scores = self.tokens.get, self.scores
        start = 0
        while start < n:
            width = min(_UTF8_LEN[norm[start] >> 4], n - start)
            base = best[start][0]
            single = False
            for end in range(start + 1, min(n, start + self.max_len) + 1):
                tid = tokens(norm[start:end])
                if tid is None:
                    continue
                single |= end - start == width
                score = base + scores[tid]
                if score > best[end][0]:
                    best[end] = (score, start, tid)
            if not single:
                score = base + self.unk_score
                if score > best[start + width][0]:
                    best[start + width] = (score, start, self.unk_id)
            start += width
        ids = []
        end, prev_unknown = n, False
        while True:
            _, begin, tid = best[end]
            unknown = tid == self.unk_id
            if not (prev_unknown and unknown):
                ids.append(tid)
            if begin == 0:
                break
            prev_unknown, end = unknown, begin
        out.extend(reversed(ids))
