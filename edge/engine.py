"""The engine: one loaded model with its tokenizer and chat template, and generation.

The CLI, the server and the TUI go through :class:`Engine`; none of them touches the
kernels. Generation is a generator of token ids, the generation loop (edge.generate) with one
sequence; :class:`GenerationStats` records what ``edge run`` reports (prompt tokens, TTFT,
prompt and generated tokens per second).
"""
from __future__ import annotations

import re
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge.chat_template import ChatTemplate, ChatTemplateError, require_template
from edge.generate import ContextLengthExceeded, GenerationLoop, GenerationStopped, Limits
from edge.gguf_file import GGUFFile
from edge.kv.cache import PagedKVCache, kv_row
from edge.session import load_session, model_fingerprint, save_session
from edge.models import load_model
from edge.sampling import LogitsProcessor, SamplingParams
from edge.threads import AdaptiveThreads
from edge.tokenizer import Tokenizer

DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512
_SENTINEL = "\ue000edge-content-{}\ue001"  # private-use code points never produced by templates
_SENTINEL_RE = re.compile("\ue000edge-content-(\\d+)\ue001")


__all__ = ["ContextLengthExceeded", "Engine", "GenerationStats", "GenerationStopped"]


@dataclass
class GenerationStats:
    """Timings of one generation. Times in seconds, measured with time.perf_counter."""

    n_prompt: int = 0
    n_cached: int = 0            # prompt tokens whose K/V came from the prefix cache
    n_restored: int = 0          # prompt tokens whose K/V came from a session file
    session_replaced: bool = False  # the session file held another prompt (it is rewritten)
    context_full: bool = False   # generation stopped at n_ctx
    n_generated: int = 0
    ttft: float = 0.0            # start of generate() to the first token sampled
    prompt_seconds: float = 0.0  # prefill time
    decode_seconds: float = 0.0  # from the first token to the last
    finish_reason: str | None = None  # "stop" (end of generation) or "length"
    n_drafted: int = 0           # speculative decoding: drafted tokens verified
    n_accepted: int = 0          # and those kept

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        """Generated tokens per second after the first (the first token's time is TTFT)."""
        n = self.n_generated - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


@dataclass
class Engine:
    """A GGUF model ready to generate.

    Args:
        path: GGUF file.
        n_ctx: context size in tokens (KV cache positions per sequence).
        n_batch: prefill chunk size in tokens.
        n_seq: sequences the KV cache holds at once.
        block_size: KV cache block size in tokens.
        cache_type_k, cache_type_v: KV cache types, "f16" (default), "q8_0" or "f32".
        kv_storage: "file" (the KV pool is a memory-mapped file under $EDGE_HOME/kv; anonymous
            memory when that file cannot be made) or "anon".
        batch_invariant: False (default): llama.cpp's choice of kernel per batch size, its
            bits on this CPU. True: one arithmetic for every row whatever the batch
            (Transformer.set_batch_invariant), as ``edge serve`` computes: a prompt's logits
            are the same prefilled in one chunk, in several, or decoded token by token (last
            bits differ from llama.cpp's; prefill and batches of Q5_0 / Q8_0 weights faster).

    Generation goes through one paged KV cache (edge.kv.cache), kept for the engine's life:
    a prompt that starts like an earlier one (the next turn of a chat) reuses its cached
    blocks. ``threads`` (edge.threads.AdaptiveThreads.from_env()) is the thread policy of every
    forward pass on the model (fewer threads while other processes keep cores busy). Raises
    GGUFError / UnsupportedArchitecture for a bad or unsupported file, ValueError for bad sizes
    or KV types.
    """

    path: Path
    n_ctx: int = DEFAULT_N_CTX
    n_batch: int = DEFAULT_N_BATCH
    n_seq: int = 1
    block_size: int = 16
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    kv_storage: str = "file"
    batch_invariant: bool = False
    gguf: GGUFFile = field(init=False)

    def __post_init__(self):
        if self.n_ctx < 1 or self.n_batch < 1:
            raise ValueError(f"n_ctx ({self.n_ctx}) and n_batch ({self.n_batch}) must be positive")
        self.gguf = GGUFFile(self.path)
        self.model = load_model(self.gguf)
        self.model.set_batch_invariant(self.batch_invariant)
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.template: ChatTemplate | None = ChatTemplate.from_gguf(self.gguf)
        self.name = self.gguf.get_str("general.name", default=Path(self.path).stem)
        kv_row(self.cache_type_k, self.model.args.head_dim)   # refuse bad KV types before any work
        kv_row(self.cache_type_v, self.model.args.head_dim_v)
        self._kv: PagedKVCache | None = None
        self._fingerprint: str | None = None
        self.threads = AdaptiveThreads.from_env()
        self.speculator = None   # edge.speculative.Speculator: set_speculative

    def set_speculative(self, params, draft_engine=None) -> None:
        """Speculative decoding (edge.speculative) for the generations of :meth:`generate` and
        :meth:`loop`: ``params`` an edge.speculative.SpecParams (spec_type "none" turns it
        off), ``draft_engine`` the draft model's Engine for "draft". Speculation verifies drafts
        in steps of many rows, so the model runs batch-invariant from here on (the tokens are
        then those of batch-invariant decoding without speculation).

        Raises:
            edge.speculative.SpeculativeError: "draft" without a draft model or with one whose
                vocabulary differs.
        """
        from edge.speculative import make_speculator

        if self.speculator is not None:
            self.speculator.close()
        self.speculator = make_speculator(params, self, draft_engine)
        if self.speculator is not None:
            self.batch_invariant = True
            self.model.set_batch_invariant(True)
            if draft_engine is not None:
                draft_engine.batch_invariant = True
                draft_engine.model.set_batch_invariant(True)

    @property
    def kv(self) -> PagedKVCache:
        """The engine's paged KV cache (created on first use)."""
        if self._kv is None:
            st = Path(self.path).stat()
            key = f"{Path(self.path).resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
            self._kv = PagedKVCache(self.model.args, self.n_ctx, self.n_seq, self.block_size,
                                    self.cache_type_k, self.cache_type_v, model_key=key, storage=self.kv_storage)
        return self._kv

    @property
    def fingerprint(self) -> str:
        """SHA-256 naming the model file's content (edge.session.model_fingerprint)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.gguf)
        return self._fingerprint

    def loop(self, cache=None) -> GenerationLoop:
        """The generation loop (edge.generate) over the model and ``cache`` (default: the
        engine's KV cache), with the engine's n_batch and thread policy."""
        return GenerationLoop(self.model, self.kv if cache is None else cache, self.tokenizer,
                              self.n_batch, self.threads, self.speculator if cache is None else None)

    def clear_kv_cache(self) -> None:
        """Forget every cached prefix (the next generation computes its whole prompt, as a cold
        run does: reused blocks were computed in other chunkings, which can change the last bits
        of the logits, as with llama.cpp's prompt cache)."""
        if self._kv is not None:
            self._kv.close()
            self._kv = None

    # ------------------------------------------------------------------ prompts
    def _one_bos(self, ids: list[int]) -> list[int]:
        """Exactly one leading BOS when the model wants one (BUGS.md T3)."""
        tok = self.tokenizer
        if not tok.add_bos:
            return ids
        while len(ids) >= 2 and ids[0] == ids[1] == tok.bos_id:
            ids = ids[1:]
        return ids if ids and ids[0] == tok.bos_id else [tok.bos_id] + ids

    def raw_prompt(self, text: str) -> list[int]:
        """Token ids of a raw completion prompt: special tokens in the text are parsed, and
        it starts with one BOS when the model adds BOS."""
        return self._one_bos(self.tokenizer.encode(text, add_special=False, parse_special=True))

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    variables: dict | None = None) -> list[int]:
        """Token ids of a chat rendered through the model's own template.

        The template's markers are special tokens; every string of the request is tokenized
        with parse_special off (BUGS.md T2), wherever and however the template writes it, so a
        user cannot forge a turn boundary: the messages' contents (:func:`_content_spans`), and
        their other fields (tool calls' names, arguments and ids, ``tool_call_id``, ``name``)
        and the variables (``tools``: names, descriptions, schemas) (:func:`_special_spans`).
        ``variables``: extra template variables (``enable_thinking``, ``tools`` ...;
        ChatTemplate.render).

        Raises:
            NoChatTemplateError: the model has no template.
            ChatTemplateError: the template's error, or special-token text in the request that the
                template does not write as it is (so it cannot be kept as text).
        """
        template = require_template(self.template, self.name)
        rendered = template.render(messages, add_generation_prompt=add_generation_prompt, **(variables or {}))
        spans = _content_spans(template, messages, add_generation_prompt, rendered, variables)
        spans += _special_spans(template, self.tokenizer, messages, add_generation_prompt, rendered, variables)
        ids = self.tokenizer.encode(rendered, add_special=False, parse_special=True, protect=spans)
        return self._one_bos(ids)

    # ------------------------------------------------------------------ embeddings
    def embed(self, inputs, pooling: str | None = None, normalize: int = 2, truncate: bool = False,
              lock=None) -> list[np.ndarray]:
        """Embeddings of a text, a token list, or a list of texts / token lists, equal to
        llama.cpp's (edge.embedding.embed: the output norm's result pooled "mean", "cls",
        "last" or "none", default the GGUF's pooling_type else "last"; normalised as
        common_embd_normalize, ``normalize`` 2 = euclidean, -1 none). Returns one array per
        input: f32[n_embd], or f32[n_tokens, n_embd] with pooling "none". Runs in a scratch KV
        cache (the engine's cache and sequences are untouched); not reentrant with other
        forwards of this engine (``lock`` is taken around each forward pass).

        Raises edge.embedding.EmbeddingError (empty input, bad token id, pooling or
        normalize), ContextLengthExceeded (an input longer than n_ctx, unless ``truncate``).
        """
        from edge.embedding import embed

        return embed(self, inputs, pooling, normalize, truncate, lock).vectors

    def warm_up(self) -> None:
        """Compile (or load from numba's cache) the kernels every generation runs before the
        first real prompt waits on them: GenerationLoop.warm_up (9-row and longer prefills, a
        sampled token, a 1-row step), as ``edge serve`` does before it says ready and as
        llama.cpp's warm-up run. It runs in a small KV cache of anonymous memory of the
        engine's K/V types (the same kernels), closed again: the engine's pool and its file
        are untouched."""
        if self.n_ctx < 10:
            return
        cache = PagedKVCache(self.model.args, min(self.n_ctx, 128), 1, self.block_size, self.cache_type_k,
                             self.cache_type_v, storage="anon")
        try:
            self.loop(cache).warm_up()
        finally:
            cache.close()

    # ------------------------------------------------------------------ generation
    def new_cache(self):
        """A fresh contiguous single-sequence f16 KV cache of n_ctx (perplexity, tests)."""
        return self.model.new_cache(self.n_ctx)

    def prefill(self, ids: Sequence[int], cache, seq: int = 0, stop=None) -> np.ndarray:
        """Append ``ids`` to sequence slot ``seq`` of ``cache`` in chunks of n_batch
        (GenerationLoop.prefill); returns the last logits f32[n_vocab]. Raises
        ContextLengthExceeded when they do not fit in n_ctx, GenerationStopped when ``stop`` (a
        threading.Event) is set before a chunk."""
        return self.loop(cache).prefill(seq, ids, stop)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                 max_tokens: int | None = None, stats: GenerationStats | None = None,
                 session: str | Path | None = None, session_save: str = "prompt",
                 stop=None, processors: Sequence[LogitsProcessor] = ()) -> Iterator[int]:
        """Yield generated token ids until an end-of-generation token (not yielded), max_tokens
        (None = no limit) or the end of the context (edge.generate's finish rules). ``stats``
        (optional) is filled in as it goes. ``processors``: the sampler's mask stage
        (edge.sampling.LogitsProcessor).

        ``session``: a session file (llama.cpp's --prompt-cache). When it exists, the KV cache
        of the tokens it shares with the start of the prompt is restored instead of computed
        (with the saved logits when it holds the whole prompt; a sliding-window model reuses a
        shorter common prefix only while the file still holds that prefix's window); after the
        prompt, its state is saved there (atomically) for the next run. With ``session_save``
        "end" the state is saved when the generation ends instead (also when the caller stops
        early by closing the generator): the prompt and the generated tokens, so that a chat's
        next turn, whose prompt starts with this one and its answer, restores both.

        ``stop``: a threading.Event; set while the prompt is computed, generation ends with
        GenerationStopped between two chunks of n_batch tokens (once tokens flow, the caller
        stops by closing the generator).

        Raises ContextLengthExceeded if the prompt is longer than n_ctx, ValueError for a
        max_tokens that is neither None nor >= 0,
        SessionError for a session file made with another model or KV type, or damaged,
        edge.kv.cache.KVNoSpace when the file system of the KV pool file is full (the
        sequence is freed; tokens already yielded stand).
        """
        stats = stats if stats is not None else GenerationStats()
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) > self.n_ctx:      # a prompt of n_ctx tokens still gets one token
            raise ContextLengthExceeded(len(prompt_ids), self.n_ctx)
        if session_save not in ("prompt", "end"):
            raise ValueError(f"session_save must be 'prompt' or 'end', got {session_save!r}")
        loop = self.loop()
        seq = loop.new(prompt_ids, params, Limits(max_tokens), processors)
        stats.n_prompt = len(prompt_ids)
        t0 = time.perf_counter()
        seq.slot, seq.logits = self._start(prompt_ids, stats, session, save=session_save == "prompt", stop=stop,
                                           lookahead=seq.lookahead)
        try:
            if seq.spec is not None:       # a draft model takes in the prompt as part of the prompt's time
                self.speculator.drafter.prefill([seq])
            stats.prompt_seconds = time.perf_counter() - t0
            t_first = None
            for out in loop.run(seq):
                now = time.perf_counter()
                if out.token is not None:        # sampled (an end-of-generation token too)
                    if t_first is None:
                        t_first = now
                        stats.ttft = now - t0
                    stats.decode_seconds = now - t_first
                elif t_first is None:            # -n 0: the time to the first token's logits
                    stats.ttft = now - t0
                if out.generated:
                    stats.n_generated += 1
                    yield out.token
                if out.finish_reason is not None:
                    stats.finish_reason = out.finish_reason
                    stats.context_full = seq.context_full
                if seq.spec is not None:
                    stats.n_drafted, stats.n_accepted = seq.spec.drafted, seq.spec.accepted
        finally:
            try:
                if session is not None and session_save == "end":
                    save_session(session, self, seq.slot, seq.logits)
            finally:
                loop.free(seq)

    def _start(self, prompt_ids: list[int], stats: GenerationStats, session, save: bool = True,
               stop=None, lookahead: int = 0) -> tuple[int, np.ndarray]:
        """A new sequence holding the prompt, and the logits after it: from the session file
        where it matches, then from the prefix cache, the rest computed; with ``save``, the
        prompt's state written to the session file."""
        kv = self.kv
        saved = None
        if session is not None and Path(session).exists() and not _empty_file(session):
            saved = load_session(session, self)
            n = len(saved.tokens)
            common = _common_prefix(saved.tokens.tolist(), prompt_ids)
            if common < n or n > len(prompt_ids):   # another prompt: reuse what they share
                # a prompt that starts the saved one leaves the file as it is (llama.cpp saves
                # only when the prompt has tokens the file lacks)
                keep_file = common == len(prompt_ids)
                stats.session_replaced = not keep_file
                m = min(common, len(prompt_ids) - 1)   # the last prompt token is computed again
                saved = saved.prefix(m, kv.first_position) if m > 0 else None
                if keep_file:
                    session = None
        if saved is None:
            slot, stats.n_cached = kv.new_sequence(prompt_ids, lookahead=lookahead)
        else:
            slot = kv.import_sequence(saved.tokens, saved.ks, saved.vs, lookahead=lookahead)
            stats.n_restored = len(saved.tokens)
        try:
            rest = prompt_ids[int(kv.pos[slot]) :]
            if rest:
                if saved is not None:  # the session's tokens are reserved, the rest not yet
                    kv.append(slot, rest)
                logits = self.prefill(rest, kv, seq=slot, stop=stop)
            else:
                logits = saved.logits
            if save and session is not None and rest:
                save_session(session, self, slot, logits)
        except BaseException:
            kv.free(slot)
            raise
        return slot, logits


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _empty_file(path) -> bool:
    """True for an existing empty file (made by touch or mktemp): a session not yet written."""
    p = Path(path)
    return p.is_file() and p.stat().st_size == 0


_special_patterns: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _special_pattern(tokenizer) -> "re.Pattern | None":
    """A regex of the tokenizer's special-token texts (longest first), None when it has none
    (made once per tokenizer)."""
    if tokenizer not in _special_patterns:
        texts = tokenizer.special_texts()
        _special_patterns[tokenizer] = re.compile("|".join(map(re.escape, texts))) if texts else None
    return _special_patterns[tokenizer]


def _special_spans(template: ChatTemplate, tokenizer, messages: list[dict], add_generation_prompt: bool,
                   rendered: str, variables: dict | None) -> list[tuple[int, int]]:
    """Character spans in ``rendered`` of the special-token texts that the request wrote outside
    the messages' contents (every other message field, every variable, keys included).

    Renders once more with each such occurrence replaced by a marker (private-use characters and
    a random nonce, which ``tojson`` and string filters leave as they are); putting the texts
    back in place of the markers must give ``rendered``, and their places are the spans. No
    special text in those strings (the usual case): no second render.

    Raises:
        ChatTemplateError: the template did not write such a text as it is (the second render
            differs or fails), so it cannot be kept as text.
    """
    pattern = _special_pattern(tokenizer)
    if pattern is None:
        return []
    nonce, found = uuid.uuid4().hex, []

    def defuse(value):
        if isinstance(value, str):
            if not pattern.search(value):
                return value

            def mark(m):
                found.append(m.group())
                return f"\ue000{nonce}:{len(found) - 1}\ue001"
            return pattern.sub(mark, value)
        if isinstance(value, dict):
            return {defuse(k): defuse(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [defuse(v) for v in value]
        return value

    marked = [{k: v if k in ("role", "content") else defuse(v) for k, v in m.items()} for m in messages]
    marked_variables = defuse(variables or {})
    if not found:
        return []
    refused = ChatTemplateError(f"the request holds the special-token text {found[0]!r} in a tool, a tool call or a "
                                "message field that this chat template does not write as it is, so it cannot be "
                                "kept as text; remove it")
    try:
        text = template.render(marked, add_generation_prompt=add_generation_prompt, **marked_variables)
    except ChatTemplateError:
        raise refused from None
    spans, out, pos, n = [], [], 0, 0
    for m in re.finditer(f"\ue000{nonce}:(\\d+)\ue001", text):
        out.append(text[pos:m.start()])
        n += m.start() - pos
        special = found[int(m.group(1))]
        out.append(special)
        spans.append((n, n + len(special)))
        n += len(special)
        pos = m.end()
    out.append(text[pos:])
    if "".join(out) != rendered:
        raise refused
    return spans


def _content_spans(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool,
                   rendered: str, variables: dict | None = None) -> list[tuple[int, int]]:
    """Character spans of the message contents inside ``rendered``, in linear time.

    Renders once more with each content replaced by a unique sentinel, which splits the
    prompt into the template's own text and the contents, and walks ``rendered`` along it: each
    content as it is or stripped of surrounding whitespace (templates that ``trim``), the longest
    that is followed by the template's next text. If the walk fails (the template changes
    contents otherwise, or its output depends on them), falls back to finding each content's
    text in order, within a scanning budget of a few times the prompt's length. ``variables``:
    the extra template variables ``rendered`` was rendered with.
    """
    contents = {i: m["content"] for i, m in enumerate(messages) if isinstance(m.get("content"), str)}
    marked = [dict(m, content=_SENTINEL.format(i)) if i in contents else m for i, m in enumerate(messages)]
    try:
        parts = _SENTINEL_RE.split(template.render(marked, add_generation_prompt=add_generation_prompt,
                                                   **(variables or {})))
    except ChatTemplateError:
        parts = []
    if parts:
        spans = _walk_contents(rendered, parts[0::2], [contents.get(int(i), "") for i in parts[1::2]])
        if spans is not None:
            return spans
    spans, pos = [], 0
    budget = 8 * len(rendered) + sum(len(t) for t in contents.values())
    for text in contents.values():
        if not text or budget <= 0:
            continue
        end = min(len(rendered), pos + budget)
        j = rendered.find(text, pos, end)
        if j >= 0:
            spans.append((j, j + len(text)))
            budget -= j + len(text) - pos
            pos = j + len(text)
        else:
            budget -= end - pos
    return spans


def _walk_contents(rendered: str, pieces: list[str], texts: list[str]) -> list[tuple[int, int]] | None:
    """The spans of ``texts`` when ``rendered`` is pieces[0] + texts[0]' + pieces[1] + ... with
    each text' the text itself or stripped (left, right or both); None if it is not."""
    spans, pos = [], 0
    for k, text in enumerate(texts):
        if not rendered.startswith(pieces[k], pos):
            return None
        pos += len(pieces[k])
        following = pieces[k + 1]
        fits = [c for c in sorted({text, text.strip(), text.lstrip(), text.rstrip()}, key=len, reverse=True)
                if rendered.startswith(c, pos) and rendered.startswith(following, pos + len(c))]
        if not fits:
            return None
        spans.append((pos, pos + len(fits[0])))
        pos += len(fits[0])
    if rendered[pos:] != pieces[-1]:
        return None
    return spans
