"""Incremental UTF-8 decoding for streamed tokens (BUGS.md T5)."""
from __future__ import annotations

import codecs


class StreamDecoder:
    """Turns token bytes arriving one piece at a time into text that is safe to print.

    A token may end inside a UTF-8 character (byte-level BPE splits emoji, SPM emits byte
    tokens). :meth:`feed` returns only complete characters and holds back an incomplete tail;
    bytes that can never start or continue a character become U+FFFD at once. :meth:`flush`
    ends the stream: a held-back incomplete tail becomes U+FFFD only then.

    Example::

        dec = StreamDecoder()
        for t in ids: print(dec.feed(tok.token_to_piece(t)), end="")
        print(dec.flush())
    """

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        """Add bytes; return the text completed so far (possibly "")."""
        return self._decoder.decode(data, final=False)

    @property
    def pending(self) -> bytes:
        """The bytes held back: the start of a character not yet complete."""
        return self._decoder.getstate()[0]

    def flush(self) -> str:
        """End of stream: return the rest (an incomplete tail as U+FFFD) and reset."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
