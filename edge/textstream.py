"""Generated tokens to text, with stop strings (BUGS.md S1).

A stop string may arrive split over several tokens, and a token may end inside a UTF-8
character. :class:`TextStream` takes token ids one at a time and releases text only once it
cannot be the start of a stop string: the longest tail of the text so far that is a prefix of
some stop string is held back until the next tokens decide it. When a stop string appears, the
text before it is released, the stop string and everything after it are dropped, and the
stream reports the stop. OpenAI's ``stop`` and llama-server's ``stop`` behave this way.

Tokens are released with the text: each generated token is reported once all of its text has
been released (the tokens that make up a stop string never are), so logprobs can follow the
text they belong to.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from edge.tokenizer import StreamDecoder


@dataclass
class Released:
    """What one call released: ``text`` (may be empty) and the indices (in generation order)
    of the tokens whose text is now wholly released; ``stopped`` when a stop string matched."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    stopped: bool = False


class TextStream:
    """Detokenizes generated tokens and cuts the text at the first stop string.

    Args:
        tokenizer: edge.tokenizer.Tokenizer (token_to_piece gives a token's bytes).
        stop: stop strings (empty strings are ignored).

    Call :meth:`push` for every generated token (not the end-of-generation token), and
    :meth:`finish` when generation ends for another reason; after a stop, further calls
    release nothing.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._dec = StreamDecoder()
        self._held = ""        # decoded text not yet released
        self._ends: list[int] = []   # per token pushed: characters decoded once it was in
        self._next = 0         # first token not yet reported
        self._released = 0     # characters released
        self._total = 0        # characters decoded
        self.stopped = False
        self.matched: str | None = None   # the stop string that ended the text, once one did
        self.text = ""         # all text released

    def push(self, token_id: int) -> Released:
        """Add one generated token; returns what can be released now."""
        if self.stopped:
            return Released()
        self._add(self._dec.feed(self._tok.token_to_piece(token_id)))
        self._ends.append(self._total)
        return self._release(final=False)

    def finish(self) -> Released:
        """Generation ended (length or end-of-generation token): release the rest (an
        incomplete UTF-8 tail as U+FFFD), unless it holds a stop string."""
        if self.stopped:
            return Released()
        self._add(self._dec.flush())
        if self._ends:
            self._ends[-1] = self._total   # the flushed tail is the last token's bytes
        return self._release(final=True)

    def _add(self, text: str) -> None:
        self._held += text
        self._total += len(text)

    def _release(self, final: bool) -> Released:
        cut, stopped = len(self._held), False
        for s in self._stop:
            i = self._held.find(s)
            if i != -1 and i < cut:
                cut, stopped, self.matched = i, True, s
        if not stopped and not final:
            cut -= self._partial_stop_tail()
        out = self._held[:cut]
        self._held = "" if stopped else self._held[cut:]
        self._released += len(out)
        self.text += out
        self.stopped = stopped
        done = []
        last = len(self._ends) - 1
        while self._next <= last and self._ends[self._next] <= self._released and not (
                self._next == last and self._dec.pending and not final and not stopped):
            done.append(self._next)
            self._next += 1
        return Released(out, done, stopped)

    def _partial_stop_tail(self) -> int:
        """Length of the longest tail of the held text that starts some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._held)), best, -1):
                if self._held.endswith(s[:n]):
                    best = n
                    break
        return best
