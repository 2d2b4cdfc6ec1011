"""Byte-level BPE with ranked merges (llama.cpp ``llm_tokenizer_bpe_session``)."""
from __future__ import annotations

import heapq

from edge.tokenizer.pretokenize import PreTokenizer, bytes_to_mapped, decode_utf8_lossy

_CACHE_LIMIT = 65536  # pre-token -> ids memo entries before the memo is cleared


class BPEModel:
    """GPT-2 style byte-level BPE, or BPE over raw UTF-8 text (Gemma 4).

    Algorithm (llama.cpp ``llm_tokenizer_bpe_session::tokenize``): read the text as UTF-8
    (:func:`decode_utf8_lossy`), split it into pre-tokens, map each pre-token's bytes to the
    byte-level alphabet (unless ``byte_encode`` is off), then per pre-token queue every adjacent
    pair that has a merge rank
    (lowest rank first, then leftmost), pop, skip stale pairs, merge, and queue the new pair on
    each side. Each final symbol is looked up in the vocab; a symbol that is not a token yields
    the tokens of its single UTF-8 bytes that are tokens (llama.cpp's fallback, normally unused;
    without ``byte_encode`` the byte tokens are ``<0xXX>``).

    Args:
        token_to_id: token text (byte-level alphabet, as stored in the GGUF) -> id.
        merges: ``tokenizer.ggml.merges``, "left right" strings; rank = index, first wins.
        pre_tokenizer: the pre-token splitter.
        ignore_merges: emit a pre-token whole when it is itself a token (llama 3).
        byte_encode: map pre-tokens to the GPT-2 byte-level alphabet (off: raw text).
        newline_tokens: emit a pre-token of newlines only whole when it is a token (Gemma 4).
    """

    def __init__(self, token_to_id: dict[str, int], merges: list[str], pre_tokenizer: PreTokenizer,
                 ignore_merges: bool, byte_encode: bool = True, newline_tokens: bool = False):
        self.token_to_id = token_to_id
        # keyed by the merge string itself: "left right" for a pair of space-free symbols is
        # exactly the merge line llama.cpp splits at its first space after index 0
        self.ranks = {m: r for r, m in zip(range(len(merges) - 1, -1, -1), reversed(merges))}
        self.pre_tokenizer = pre_tokenizer
        self.ignore_merges = ignore_merges
        self.byte_encode = byte_encode
        self.newline_tokens = newline_tokens
        self._memo: dict[str, tuple[int, ...]] = {}

    def tokenize(self, text: bytes, out: list[int]) -> None:
        """Append the token ids of ``text`` (raw bytes, any content) to ``out``."""
        memo = self._memo
        for piece in self.pre_tokenizer.split(decode_utf8_lossy(text)):
            word = bytes_to_mapped(piece.encode("utf-8", "surrogatepass")) if self.byte_encode else piece
            ids = memo.get(word)
            if ids is None:
                if len(memo) >= _CACHE_LIMIT:
                    memo.clear()
                ids = memo[word] = self._word(word)
            out.extend(ids)

    def _word(self, word: str) -> tuple[int, ...]:
        get = self.token_to_id.get
        if (self.ignore_merges or self.newline_tokens and not word.strip("\n")) and word in self.token_to_id:
            return (self.token_to_id[word],)
        syms = list(word)
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        ranks = self.ranks
        heap: list[tuple[int, int, int, str]] = []

        def add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            rank = ranks.get(syms[left] + " " + syms[right])
            if rank is not None:
                heapq.heappush(heap, (rank, left, right, syms[left] + syms[right]))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, right, text = heapq.heappop(heap)
            a, b = syms[left], syms[right]
            if not a or not b or a + b != text:
                continue  # outdated pair
            syms[left] = text
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add(prv[left], left)
            add(left, nxt[left])

        ids = []
        for sym in syms:
            if not sym:
                continue
            tid = get(sym)
            if tid is not None:
                ids.append(tid)
                continue
            for byte in sym.encode("utf-8", "surrogatepass"):
                tid = get(bytes([byte]).decode("utf-8", "surrogateescape") if self.byte_encode else f"<0x{byte:02X}>")
                if tid is not None:
                    ids.append(tid)
        return tuple(ids)
