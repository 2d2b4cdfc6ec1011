"""Tokenizers from GGUF metadata, agreeing with llama.cpp token for token.

``Tokenizer.from_gguf(gf)`` builds a SentencePiece ("llama") or byte-level BPE ("gpt2")
tokenizer; ``encode`` gives ids, ``decode``/``token_to_piece`` give bytes, and
``StreamDecoder`` turns streamed bytes into printable text.
"""
from edge.tokenizer.core import Tokenizer
from edge.tokenizer.stream import StreamDecoder
from edge.tokenizer.vocab import TokenAttr, TokenizerError

__all__ = ["Tokenizer", "StreamDecoder", "TokenAttr", "TokenizerError"]
