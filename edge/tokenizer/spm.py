"""SentencePiece-style BPE over vocabulary scores (llama.cpp ``llm_tokenizer_spm_session``)."""
from __future__ import annotations

import heapq
import re

# one "character" per UTF-8 lead byte, length from its high bits, clamped at the end of the text
# and not validated (llama.cpp ``unicode_len_utf8``): 0x00-0xBF -> 1, 0xC0-0xDF -> 2, ...
_UTF8_CHAR = re.compile(
    rb"[\x00-\xbf]|[\xc0-\xdf][\x00-\xff]?|[\xe0-\xef][\x00-\xff]{0,2}|[\xf0-\xff][\x00-\xff]{0,3}",
    re.DOTALL,
)


def _surrogateescape(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


class SPMModel:
    """Merges adjacent symbols into the highest-scoring vocab token until none is left.

    Algorithm (llama.cpp ``llm_tokenizer_spm_session::tokenize``): split the (already
    space-escaped) text into UTF-8 characters; queue every adjacent pair whose concatenation is
    a token, by score (highest first, then leftmost); pop, skip pairs made stale by an earlier
    merge, merge, and queue the new pair on each side. Each final symbol is its token if it is
    one, else one byte-fallback token per byte.

    Valid UTF-8 text is split into its characters and looked up as str. Other text is split
    into llama.cpp's unvalidated byte "characters" and each candidate is looked up by its
    ``surrogateescape`` str, a one-to-one image of its bytes, so lookups equal llama.cpp's.

    Args:
        token_to_id: token text (str, as stored: utf-8 with surrogateescape) -> id.
        scores: per-token score (float), indexed by id.
        unk_id: unknown token id (SPM always has one: llama.cpp's default is 0). A byte with
            neither a ``<0xXX>`` token nor a one-byte token becomes ``unk_id`` (llama.cpp's
            ``byte_to_token`` throws there).
    """

    def __init__(self, token_to_id: dict[str, int], scores: list[float], unk_id: int):
        self.token_to_id = token_to_id
        self.scores = scores
        self.byte_ids = [token_to_id.get(f"<0x{b:02X}>", token_to_id.get(_surrogateescape(bytes([b])), unk_id))
                         for b in range(256)]

    def tokenize(self, text: bytes, out: list[int]) -> None:
        """Append the token ids of ``text`` (bytes, spaces already escaped to U+2581) to ``out``."""
        try:  # symbol lengths are then in characters: the stale-pair check only needs one unit
            syms: list = list(text.decode("utf-8"))
            key = None
        except UnicodeDecodeError:
            syms = _UTF8_CHAR.findall(text)
            key = _surrogateescape
        n = len(syms)
        if n == 0:
            return
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        get, scores = self.token_to_id.get, self.scores
        heap: list[tuple[float, int, int, int]] = []

        def try_add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = syms[left] + syms[right]
            tid = get(merged if key is None else key(merged))
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, len(merged)))

        for i in range(1, n):
            try_add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a, b = syms[left], syms[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # one side was merged since this pair was queued
            syms[left] = a + b
            syms[right] = a[:0]
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            try_add(prv[left], left)
            try_add(left, nxt[left])

        i = 0
        while i != -1:
            sym = syms[i]
            tid = get(sym if key is None else key(sym))
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.byte_ids[byte] for byte in (sym if key else sym.encode("utf-8")))
            i = nxt[i]
