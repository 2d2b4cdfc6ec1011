"""llama-server's native API on `edge serve`, so tools written for llama.cpp's server (editor
plugins such as llama.vscode, scripts calling /completion) work unchanged. Shapes follow
llama.cpp's tools/server (README.md, server-context.cpp, server-task.cpp, server-common.cpp);
generation goes through the OpenAI handlers (app._Handlers.start_completion) and its events are
turned into llama-server's objects here.

Routes (:func:`routes`):

- ``POST /completion``: ``prompt`` (a string, token ids, ids and strings mixed, or several
  strings: an array of answers), ``n_predict`` (-1: no limit, 0: the prompt is only cached),
  sampling fields (``temperature``, ``top_k``, ``top_p``, ``min_p``, penalties, ``seed``,
  ``samplers``, ``logit_bias`` as an object or llama-server's ``[[id or text, bias or false]]``,
  ``ignore_eos``), ``stop``, ``n_probs`` (``completion_probabilities``), ``grammar`` /
  ``json_schema``, ``return_tokens``, ``stream`` (``data: {...}`` events, the last with
  ``stop: true``; no ``[DONE]``), ``timings_per_token``, ``return_progress``, ``n_indent``,
  ``t_max_predict_ms``, ``response_fields``.
- ``POST /infill``: ``input_prefix``, ``input_suffix``, ``input_extra`` ([{filename, text}]) and
  ``prompt`` laid out with the model's FIM tokens as llama-server's format_prompt_infill
  (:func:`fim_prompt`), then as /completion.
- ``GET /props`` (``POST /props``: 501, as llama-server without ``--props``), ``GET /slots``,
  ``POST /slots/{id}?action=save|restore|erase`` (files in ``--slot-save-path``; without it 501),
  ``POST /apply-template``.

``/tokenize`` (``with_pieces``: :func:`token_pieces`) and ``/detokenize`` are app's; the
``timings`` object of every response, OpenAI's routes included, is :func:`timings`.

Errors on these routes are llama-server's ``{"error": {"code": status, "message", "type"}}``
(:func:`error_response`), with the statuses edge's OpenAI routes give.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edge import __version__
from edge.server import app as A
from edge.server import protocol as P
from edge.server.scheduler import STEP_LOCK, Delta, Finished, Progress, SlotRecord

# llama-server's error types by status (server-common.cpp format_error_response)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}
_PATHS = ("/completion", "/infill", "/props", "/slots", "/apply-template")
FLOAT_LOWEST = -3.4028234663852886e38     # llama-server's logprob of a token of probability 0
DEFAULT_SEED = 4294967295                 # LLAMA_DEFAULT_SEED: a random seed
_SMALL_BODY = 1 << 20                     # /slots actions: a file name
FIM_ALIGN = 64                            # /infill cuts a long prefix at a multiple of this many tokens


def serves(path: str) -> bool:
    """True for the routes of this module (their errors are llama-server's shape)."""
    return path in _PATHS or path.startswith("/slots/")


def error_response(path: str, err: P.APIError) -> JSONResponse:
    """``err`` as llama-server answers it: {"error": {"code": status, "message", "type"}} (type
    "exceed_context_size_error" for a prompt longer than the context, as llama-server's)."""
    kind = _ERROR_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    if err.code == "context_length_exceeded":
        kind = "exceed_context_size_error"
    if err.code == "infill_not_supported":
        kind = "not_supported_error"
    body = {"code": err.status, "message": err.message, "type": kind, **err.extra}
    if err.param:
        body["param"] = err.param
    return JSONResponse({"error": body}, status_code=err.status, headers=err.headers)


# ---- timings ----------------------------------------------------------------------------------

def timings(fin: Finished, predicted_n: int | None = None) -> dict:
    """llama-server's ``timings`` of a generation (Finished.timings)."""
    return fin.timings(predicted_n)


def _so_far(gen, n_tokens: int, reason: str = "length") -> Finished:
    """A Finished of a generation still running (or stopped here) from its request's times:
    ``n_tokens`` generated so far."""
    t0 = gen.t_submit
    return Finished(reason, len(gen.prompt_ids), n_tokens, gen.n_cached,
                    ttft=None if gen.t_first is None else gen.t_first - t0,
                    queue_wait=None if gen.t_admit is None else gen.t_admit - t0,
                    duration=time.perf_counter() - t0)


# ---- request bodies ---------------------------------------------------------------------------

class CompletionBody(P._Sampling):
    """POST /completion (and /infill's sampling part): llama-server's fields (module docstring)
    beside those edge's completions share (protocol._Sampling)."""

    prompt: Any = None
    logit_bias: list | dict | None = None
    cache_prompt: bool = True                  # edge's prefix cache is always on
    return_tokens: bool = False
    timings_per_token: bool = False
    return_progress: bool = False
    post_sampling_probs: bool = False
    id_slot: int = -1                          # edge's prefix cache is shared by every slot
    n_keep: int | None = None                  # no context shift: accepted, unused
    n_discard: int | None = None
    n_cache_reuse: int | None = None
    t_max_prompt_ms: int | None = None         # a TODO of llama-server too: accepted, unused
    n_indent: Annotated[int, Field(ge=0)] | None = None
    t_max_predict_ms: Annotated[int, Field(ge=0)] | None = None
    response_fields: list[str] | None = None
    n_cmpl: int | None = None

    NOT_IMPLEMENTED: ClassVar[dict] = {k: v for k, v in P._SAMPLING_NOT_IMPLEMENTED.items()
                                       if k not in ("n_indent", "t_max_predict_ms")}


class ExtraChunk(P._Body):
    text: str
    filename: str = "tmp"


class InfillBody(CompletionBody):
    """POST /infill: the code around the cursor, repository context and /completion's fields."""

    input_prefix: str | list
    input_suffix: str | list
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""


class SlotFile(P._Body):
    filename: str


# ---- prompts ----------------------------------------------------------------------------------

def _mixed(tok, value, param: str, parse_special: bool) -> list[int]:
    """Token ids of a string or a list of token ids and strings (llama-server's tokenize_mixed)."""
    if isinstance(value, str):
        return tok.encode(value, add_special=False, parse_special=parse_special)
    out = []
    for item in value:
        if isinstance(item, str):
            out += tok.encode(item, add_special=False, parse_special=parse_special)
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item < tok.n_vocab:
            out.append(item)
        else:
            raise P.APIError(400, f"{param}: expected a string, or token ids (0..{tok.n_vocab - 1}) and strings; "
                                  f"got {P._short(item)}", param=param, code="invalid_value")
    return out


def prompt_list(engine, prompt) -> list[list[int]]:
    """The token ids of /completion's ``prompt``: one prompt (a string, token ids, or token ids and
    strings mixed: BOS first when it starts with a string and the model adds BOS), or several
    (a list of strings or of such lists). Raises APIError (400) for other values or an empty one."""
    if prompt is None or prompt == "" or prompt == []:
        raise P.APIError(400, "\"prompt\" is required: a string, token ids, or a list of them", param="prompt",
                         code="invalid_value")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
            and (len(prompt) > 1 or isinstance(prompt[0], list)):
        return [prompt_list(engine, p)[0] for p in prompt]
    if not isinstance(prompt, (str, list)):
        raise P.APIError(400, f"prompt: expected a string or a list, got {P._short(prompt)}", param="prompt",
                         code="invalid_value")
    items = [prompt] if isinstance(prompt, str) else prompt
    ids = _mixed(engine.tokenizer, items[1:], "prompt", True)
    if isinstance(items[0], str):
        ids = engine.raw_prompt(items[0]) + ids
    else:
        ids = _mixed(engine.tokenizer, items[:1], "prompt", True) + ids
    if not ids:
        raise P.APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    return [ids]


def fim_prompt(tok, input_prefix, input_suffix, input_extra: list, prompt_ids: list[int], n_batch: int,
               n_predict: int, n_ctx: int, model: str = "this model") -> list[int]:
    """The token ids of a fill-in-the-middle request, laid out as llama-server's
    format_prompt_infill (repo-level pattern, arXiv 2409.12186)::

        [FIM_REP]myproject\\n [FIM_SEP]{filename}\\n{text} ... [FIM_SEP]filename\\n
        [BOS][FIM_PRE]{prefix}{prompt}[FIM_SUF]{suffix}[FIM_MID]

    The repository part comes only with ``input_extra`` (llama-server writes its FIM_REP line and
    last FIM_SEP line always: without other files they turn small models such as
    qwen2.5-coder-0.5b-instruct from code to prose) and uses the model's FIM_REP / FIM_SEP tokens
    (without FIM_SEP each chunk is put after a "--- snippet ---" line); prefix, suffix, chunks and file names are tokenized
    with special tokens as text, the prompt with them parsed. The prefix keeps at most its last
    3/4 of n_batch tokens, cut at a multiple of FIM_ALIGN tokens from its start (llama-server cuts
    at exactly 3/4 of n_batch, so that once the code above the cursor is longer, each keystroke
    moves the start of the prompt and nothing of it is cached), the suffix its first n_batch/4
    less the prompt; the repository part keeps its
    last n_ctx - n_batch - 2 * max(n_predict, 2) tokens (none when that is 0 or less).
    ``input_extra``: objects with ``text`` and ``filename``.

    Raises:
        APIError: 400 "Infill is not supported by this model: ..." when the vocabulary lacks a
            FIM prefix, suffix or middle token (GGUF tokenizer.ggml.fim_pre_token_id, fim_suf,
            fim_mid, or their older names prefix_token_id ...).
    """
    ids = tok.special_ids
    missing = [what for key, what in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle"))
               if ids.get(key) is None]
    if missing:
        raise P.APIError(501, "Infill is not supported by this model: " + "".join(f"{w} token is missing. "
                                                                                for w in missing)
                         + f"({model} has no fill-in-the-middle tokens; use a code model that has them, such as "
                           "qwen2.5-coder)", code="infill_not_supported")

    def text(s: str) -> list[int]:
        return tok.encode(s, add_special=False, parse_special=False)

    prefix = _mixed(tok, input_prefix, "input_prefix", False)
    suffix = _mixed(tok, input_suffix, "input_suffix", False)
    rep, sep = ids.get("fim_rep"), ids.get("fim_sep")
    extra: list[int] = []
    if input_extra and rep is not None:
        extra += [rep] + text("myproject\n")
    for chunk in input_extra:
        extra += [sep] + text(chunk.filename + "\n") if sep is not None else text("\n\n--- snippet ---\n\n")
        extra += text(chunk.text)
    if input_extra and sep is not None:
        extra += [sep] + text("filename\n")
    cut = max(0, len(prefix) - 3 * (n_batch // 4))
    cut = -(-cut // FIM_ALIGN) * FIM_ALIGN      # the next keystrokes' prompts start the same
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * max(n_predict, 2)), len(extra))
    head = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return (extra[len(extra) - n_extra:] + head + [ids["fim_pre"]] + prefix[cut:] + prompt_ids
            + [ids["fim_suf"]] + suffix[:n_suffix] + [ids["fim_mid"]])


# ---- sampling ---------------------------------------------------------------------------------

def _samplers(body: CompletionBody) -> dict:
    """The sampling fields llama-server's ``samplers`` list implies (app.sampler_fields: a
    sampler left out is off). "infill" turns on llama.cpp's infill sampler: the list goes on
    to app._sampling, which sets SamplingParams.infill (and app._check_samplers, which wants
    the default order, infill after every sampler that is on)."""
    if body.samplers is None:
        return {}
    return A.sampler_fields(body.samplers, body.temperature)


def _logit_bias(body: CompletionBody, tok) -> dict[str, float] | None:
    """llama-server's logit_bias, [[token id or text, bias or false], ...] or {"id or text":
    bias}, as {token id: bias} (false: -inf; a text biases each of its tokens). Raises
    APIError (400) for a malformed entry."""
    lb = body.logit_bias
    if lb is None:
        return None
    pairs = list(lb.items()) if isinstance(lb, dict) else lb
    out: dict[str, float] = {}
    for entry in pairs:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise P.APIError(400, f"logit_bias: each entry is [token id or text, bias], got {P._short(entry)}",
                             param="logit_bias", code="invalid_value")
        key, value = entry
        if value is False:
            bias = -math.inf
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            bias = float(value)
        else:
            raise P.APIError(400, f"logit_bias: a bias is a number or false, got {P._short(value)}",
                             param="logit_bias", code="invalid_value")
        if isinstance(key, str) and key.lstrip("-").isdigit():
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < tok.n_vocab:
                raise P.APIError(400, f"logit_bias token {key} is not in the vocabulary (0..{tok.n_vocab - 1})",
                                 param="logit_bias", code="invalid_value")
            tokens = [key]
        elif isinstance(key, str):
            tokens = tok.encode(key, add_special=False, parse_special=False)
        else:
            raise P.APIError(400, f"logit_bias: a key is a token id or a text, got {P._short(key)}",
                             param="logit_bias", code="invalid_value")
        for t in tokens:
            out[str(t)] = bias
    return out


def _completion_request(body: CompletionBody, ids: list[int], logprobs: int | None,
                        n_predict: int) -> P.CompletionRequest:
    """edge's CompletionRequest of a llama-server body (already validated) for prompt ``ids``."""
    fields = {name: getattr(body, name) for name in P._Sampling.model_fields
              if name not in ("logit_bias", "stream", "stream_options", "n", "max_tokens",
                              "n_predict", "n_probs", "n_indent", "t_max_predict_ms")}
    fields |= _samplers(body)
    fields |= {"prompt": ids, "n_predict": n_predict, "logprobs": logprobs, "stream": False}
    if isinstance(body.stop, list):
        fields["stop"] = [s for s in body.stop if s]      # llama-server drops empty stop words
    req = P.CompletionRequest.model_construct(**fields)
    return req


def params_json(params, max_tokens: int | None, stop, n_probs: int, stream: bool = False,
                grammar: str = "", timings_per_token: bool = False, speculative: dict | None = None) -> dict:
    """llama-server's ``params`` / ``generation_settings`` of a request (task_params::to_json):
    edge's sampling parameters, the samplers edge does not have at their neutral values."""
    bias = params.logit_bias or {}
    spec = speculative or {}
    return {
        "seed": DEFAULT_SEED if params.seed is None else params.seed,
        "temperature": params.temperature, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
        "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p, "top_n_sigma": -1.0,
        "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
        "repeat_last_n": params.repeat_last_n, "repeat_penalty": params.repeat_penalty,
        "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
        "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
        "dry_sequence_breakers": ["\n", ":", "\"", "*"],
        "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
        "stop": list(stop or []), "max_tokens": -1 if max_tokens is None else max_tokens,
        "n_predict": -1 if max_tokens is None else max_tokens, "n_keep": 0, "n_discard": 0,
        "ignore_eos": False, "stream": stream,
        "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in bias.items()],
        "n_probs": n_probs, "min_keep": 0, "grammar": grammar,
        "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
        + ["infill"] * params.infill,
        "speculative.n_max": spec.get("n_max", 16), "speculative.n_min": spec.get("n_min", 0),
        "speculative.p_min": spec.get("p_min", 0.75),
        "timings_per_token": timings_per_token, "post_sampling_probs": False, "lora": [],
    }


# ---- token text -------------------------------------------------------------------------------

def _utf8_prefix(raw: bytes) -> str:
    """The text of ``raw`` without an incomplete UTF-8 character at its end (llama-server's
    validate_utf8); other invalid bytes become U+FFFD."""
    for cut in range(0, min(4, len(raw)) + 1):
        try:
            return raw[: len(raw) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return raw.decode("utf-8", errors="replace")


def _prob_entry(tok, token: int, logprob: float) -> dict:
    raw = tok.token_to_piece(token)
    return {"id": token, "token": _utf8_prefix(raw), "bytes": list(raw),
            "logprob": logprob if math.isfinite(logprob) else FLOAT_LOWEST}


def _probs(tok, lps) -> list[dict]:
    """completion_probabilities entries of TokenLogprobs (llama-server's probs_vector_to_json)."""
    return [{**_prob_entry(tok, lp.token, lp.logprob), "top_logprobs": [_prob_entry(tok, t, v) for t, v in lp.top]}
            for lp in lps]


# ---- one generation ---------------------------------------------------------------------------

class _Generation:
    """A /completion or /infill generation in flight: edge's events (app.CompletionRun's stream)
    as llama-server's partial and final objects. ``zero``: n_predict 0 (one token is generated
    and dropped: the prompt is only computed and cached)."""

    def __init__(self, run, body: CompletionBody, ids: list[int], engine, zero: bool, index: int = 0):
        self.run, self.body, self.ids, self.engine, self.zero, self.index = run, body, ids, engine, zero, index
        self.gen = run.stream.gen
        self.n_ctx = engine.n_ctx
        self.text = ""                # generated text (n_indent may cut it)
        self.tokens: list[int] = []
        self.probs: list[dict] = []
        self.n_predicted = 0
        self.stop_type = "none"
        self.stopping_word = ""
        self.progressed = 0           # prompt tokens reported processed
        self.fin: Finished | None = None
        self.n_probs = body.n_probs or 0

    def _head(self) -> dict:
        return {"index": self.index, "id_slot": self.gen.slot if self.gen.slot is not None else -1,
                "tokens_evaluated": len(self.ids)}

    def _progress(self, ev: Progress) -> dict:
        self.progressed = ev.processed
        return {**self._head(), "content": "", "tokens": [], "stop": False, "tokens_predicted": 0,
                "prompt_progress": {"total": ev.total, "cache": ev.cache, "processed": ev.processed,
                                    "time_ms": ev.seconds * 1e3}}

    def _limits(self, t_first: float | None) -> int | None:
        """Where n_indent or t_max_predict_ms end the text (llama-server's process_token): the
        length to keep, or None to go on."""
        text, body = self.text, self.body
        if "\n" not in text:
            return None
        if body.t_max_predict_ms and t_first is not None and \
                (time.perf_counter() - t_first) * 1e3 > body.t_max_predict_ms:
            return len(text)
        if body.n_indent:
            start = 0
            while (nl := text.find("\n", start)) >= 0:
                pos = nl + 1
                while pos < len(text) and text[pos] in " \t":
                    pos += 1
                if pos < len(text) and pos - (nl + 1) < body.n_indent:
                    return pos
                start = nl + 1
        return None

    async def events(self):
        """The partial objects (dicts) as the generation goes, then the final one (stop true).
        Raises APIError for a failure."""
        stream, gen = self.run.stream, self.gen
        try:
            async for ev in stream.events():
                if isinstance(ev, Progress):
                    if self.body.return_progress and self.body.stream:
                        yield self._progress(ev)
                    continue
                if self.body.return_progress and self.body.stream and self.progressed < len(self.ids) \
                        and gen.t_first is not None:
                    yield self._progress(Progress(len(self.ids), gen.n_cached, len(self.ids),
                                                  gen.t_first - (gen.t_admit or gen.t_first)))
                if isinstance(ev, Delta):
                    if self.zero:
                        continue
                    new_ids = [lp.token for lp in ev.logprobs]
                    before = len(self.text)
                    self.text += ev.text
                    self.tokens += new_ids
                    self.n_predicted += len(new_ids)
                    new_probs = _probs(self.engine.tokenizer, ev.logprobs) if self.n_probs else []
                    self.probs += new_probs
                    cut = self._limits(gen.t_first)
                    if cut is not None:
                        self.text = self.text[:cut]
                        stream.cancel()
                        self.fin = _so_far(gen, self.n_predicted)
                    if self.body.stream and (len(self.text) > before or new_ids):
                        yield self._partial(self.text[before:], new_ids, new_probs)
                    if self.fin is not None:
                        break
                else:
                    self.fin = ev
            if self.fin is None:
                return                                  # the client went away
            self.run.fin = self.fin
            yield self._final()
        finally:
            stream.cancel()

    def _partial(self, text: str, ids: list[int], probs: list[dict]) -> dict:
        out = {**self._head(), "content": text, "tokens": ids, "stop": False,
               "tokens_predicted": self.n_predicted}
        if self.body.timings_per_token:
            out["timings"] = timings(_so_far(self.gen, self.n_predicted), self.n_predicted)
        if probs:
            out["completion_probabilities"] = probs
        return out

    def _final(self) -> dict:
        fin, body = self.fin, self.body
        n = 0 if self.zero else fin.completion_tokens
        if fin.finish_reason == "stop":
            self.stop_type = "word" if fin.stop_sequence else "eos"
            self.stopping_word = fin.stop_sequence or ""
        else:
            self.stop_type = "limit"
        truncated = fin.finish_reason == "length" and fin.prompt_tokens + fin.completion_tokens >= self.n_ctx
        stream = bool(body.stream)
        engine, req = self.engine, self.run.stream.gen
        grammar = body.grammar or ("" if body.json_schema is None else json.dumps(body.json_schema))
        settings = params_json(req.params, req.max_tokens if not self.zero else 0, req.stop, self.n_probs, stream,
                               grammar, body.timings_per_token, req.speculative)
        settings |= {"n_ctx": self.n_ctx, "model": self.run.model, "ignore_eos": bool(body.ignore_eos)}
        fed = fin.prompt_tokens + max(0, fin.completion_tokens - (self.stop_type != "eos"))
        out = {"index": self.index, "content": "" if stream or self.zero else self.text,
               "tokens": [] if stream or self.zero or not (body.return_tokens) else self.tokens,
               "id_slot": self.gen.slot if self.gen.slot is not None else -1, "stop": True,
               "model": self.run.model, "tokens_predicted": n, "tokens_evaluated": fin.prompt_tokens,
               "generation_settings": settings,
               "prompt": engine.tokenizer.decode(self.ids, unparse_special=True).decode("utf-8", errors="replace"),
               "has_new_line": "\n" in self.text, "truncated": truncated, "stop_type": self.stop_type,
               "stopping_word": self.stopping_word, "tokens_cached": fed,
               "timings": timings(fin, n)}
        if self.probs and not stream and not self.zero:
            out["completion_probabilities"] = self.probs
        if body.response_fields:
            out = _fields(out, body.response_fields)
        return out


def _fields(obj: dict, paths: list[str]) -> dict:
    """llama-server's response_fields: the values at "a/b" paths, keyed by the path (missing ones left out)."""
    out = {}
    for path in paths:
        cur, ok = obj, True
        for key in path.split("/"):
            if isinstance(cur, dict) and key in cur:
                cur = cur[key]
            else:
                ok = False
                break
        if ok:
            out[path] = cur
    return out


# ---- the routes -------------------------------------------------------------------------------

class _Llama:
    def __init__(self, h):
        self.h, self.state = h, h.state

    # -- generation --

    async def completion(self, request: Request):
        """POST /completion: llama-server's completion object, several for several prompts,
        or its server-sent events with ``stream``."""
        body = await A._body(request, self.state, CompletionBody)
        slot = await self.state.acquire(body.model, body.keep_alive_seconds())
        try:
            prompts = await run_in_threadpool(prompt_list, slot.engine, body.prompt)
            if body.stream and len(prompts) > 1:
                raise P.APIError(400, "stream: several prompts in one streamed request are not supported; send "
                                      "them one by one", param="stream", code="unsupported_value")
            k = self._n_cmpl(body, len(prompts))
            gens = [await self._start(request, body, ids, slot, i * k + c, c)
                    for i, ids in enumerate(prompts) for c in range(k)]
        finally:
            self.state.pool.release(slot)
        return await self._answer(request, body, gens)

    def _n_cmpl(self, body: CompletionBody, n_prompts: int) -> int:
        """n_cmpl (alias n): completions per prompt, 1..-np as llama-server takes them; each its
        own generation (seeds seed, seed + 1, ... when one is given). Raises APIError 400."""
        k = body.n_cmpl if body.n_cmpl is not None else body.n if body.n is not None else 1
        limit = self.state.config.n_parallel
        if not 1 <= k <= limit:
            raise P.APIError(400, f"n_cmpl must be in 1..{limit} (the server's -np), got {k}", param="n_cmpl",
                             code="invalid_value")
        if body.stream and k * n_prompts > 1:
            raise P.APIError(400, "stream: several completions in one streamed request are not supported; send "
                                  "n_cmpl 1, or stream false", param="stream", code="unsupported_value")
        return k

    async def infill(self, request: Request):
        """POST /infill: the FIM prompt (:func:`fim_prompt`) generated as /completion."""
        body = await A._body(request, self.state, InfillBody)
        slot = await self.state.acquire(body.model, body.keep_alive_seconds())
        try:
            engine = slot.engine
            n_predict = self._n_predict(body)
            ids = await run_in_threadpool(self._fim, engine, body, n_predict, slot.name)
            k = self._n_cmpl(body, 1)
            gens = [await self._start(request, body, ids, slot, c, c) for c in range(k)]
        finally:
            self.state.pool.release(slot)
        return await self._answer(request, body, gens)

    def _fim(self, engine, body: InfillBody, n_predict: int, name: str) -> list[int]:
        prompt_ids = engine.tokenizer.encode(body.prompt, add_special=False, parse_special=True)
        return fim_prompt(engine.tokenizer, body.input_prefix, body.input_suffix, body.input_extra, prompt_ids,
                          self.state.config.n_batch, n_predict, engine.n_ctx, name)

    @staticmethod
    def _n_predict(body: CompletionBody) -> int:
        n = body.n_predict if body.n_predict is not None else body.max_tokens if body.max_tokens is not None else -1
        if n < -1:
            raise P.APIError(400, f"n_predict must be -1 (no limit), 0 (only cache the prompt) or more, got {n}",
                             param="n_predict", code="invalid_value")
        return n

    async def _start(self, request: Request, body: CompletionBody, ids: list[int], slot, index: int,
                     seed_offset: int = 0) -> _Generation:
        if body.post_sampling_probs:
            raise P.APIError(400, "post_sampling_probs = true is not supported by this server: its probabilities are "
                                  "those of the raw logits; leave it out", param="post_sampling_probs",
                             code="unsupported_value")
        body.check_not_implemented()
        n = self._n_predict(body)
        need_ids = bool(body.stream or body.return_tokens or body.n_probs or body.n_indent or body.t_max_predict_ms)
        logprobs = (body.n_probs or 0) if need_ids else None
        creq = _completion_request(body, ids, logprobs, 1 if n == 0 else n)
        if seed_offset and creq.seed is not None and 0 <= creq.seed < DEFAULT_SEED:
            creq.seed += seed_offset
        bias = await run_in_threadpool(_logit_bias, body, slot.engine.tokenizer)
        if bias is not None:
            creq.logit_bias = bias
        creq.progress = bool(body.return_progress and body.stream)
        run = await self.h.start_completion(request, creq)
        return _Generation(run, body, ids, slot.engine, n == 0, index)

    async def _answer(self, request: Request, body: CompletionBody, gens: list[_Generation]):
        if not body.stream:
            async def one(g: _Generation):
                last = None
                async for obj in g.events():
                    last = obj
                return last

            async def watch():           # the client went away: cancel every generation
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                for g in gens:
                    g.run.cancel()

            watcher = asyncio.create_task(watch())
            try:
                outs = await asyncio.gather(*(one(g) for g in gens))
            finally:
                watcher.cancel()
            if any(o is None for o in outs):
                return Response(status_code=A.CLIENT_GONE)
            return JSONResponse(outs[0] if len(outs) == 1 else outs)

        gen = gens[0]

        async def events():
            try:
                async for obj in gen.events():
                    yield A._sse(obj)
            except P.APIError as e:
                yield A._sse(error_body(e))
            finally:
                gen.run.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- server facts --

    async def _slot(self, request: Request):
        """The model a GET names with ?model= (default: the server's), loaded."""
        slot = await self.state.acquire(request.query_params.get("model"))
        self.state.pool.release(slot)
        return slot

    async def props(self, request: Request):
        """GET /props: llama-server's server properties."""
        slot = await self._slot(request)
        engine, tok = slot.engine, slot.engine.tokenizer
        from edge.sampling import SamplingParams

        def special(tid):
            return "" if tid is None else tok.token_to_piece(tid, special=True).decode("utf-8", errors="replace")

        n_ctx = engine.n_ctx
        defaults = {"id": 0, "id_task": -1, "n_ctx": n_ctx, "speculative": engine.speculator is not None,
                    "is_processing": False, "params": params_json(SamplingParams(), None, [], 0),
                    "prompt": "", "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1,
                                                 "n_decoded": 0, "stopping_word": ""}}
        return JSONResponse({
            "default_generation_settings": defaults, "total_slots": engine.kv.n_seq,
            "model_alias": slot.name, "model_path": str(slot.path),
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
            "chat_template": engine.template.source if engine.template is not None else "",
            "chat_template_caps": {}, "bos_token": special(tok.bos_id), "eos_token": special(tok.eos_id),
            "build_info": f"edge {__version__}", "is_sleeping": False,
        })

    async def set_props(self, request: Request):
        """POST /props: 501, as llama-server started without --props (no property can change)."""
        raise P.APIError(501, "This server does not support changing global properties (llama-server's --props)",
                         code="not_supported")

    async def slots(self, request: Request):
        """GET /slots: per KV sequence slot what it runs or last ran (llama-server's shape; with
        ?fail_on_no_slot=1 a 503 when every slot is busy)."""
        slot = await self._slot(request)
        out = await run_in_threadpool(_slot_states, slot)
        if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in out):
            raise P.APIError(503, "no slot available", code="no_slot_available")
        return JSONResponse(out)

    async def slot_action(self, request: Request):
        """POST /slots/{id}?action=save|restore|erase (:func:`_save`, :func:`_restore`, :func:`_erase`)."""
        folder = self.state.config.slot_save_path
        if not folder:
            raise P.APIError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                             code="not_supported")
        try:
            id_slot = int(request.path_params["id_slot"])
        except ValueError:
            raise P.APIError(400, "Invalid slot ID", param="id_slot", code="invalid_value") from None
        action = request.query_params.get("action")
        if action not in ("save", "restore", "erase"):
            raise P.APIError(400, "Invalid action: use ?action=save, restore or erase", param="action",
                             code="invalid_value")
        name = None
        if action != "erase":
            name = (await A._body(request, self.state, SlotFile, _SMALL_BODY)).filename
            _check_filename(name)
        slot = await self._slot(request)
        if not 0 <= id_slot < slot.engine.kv.n_seq:
            raise P.APIError(400, f"Invalid slot ID: {id_slot} (this server has slots 0..{slot.engine.kv.n_seq - 1})",
                             param="id_slot", code="invalid_value")
        if action == "erase":
            return JSONResponse(await run_in_threadpool(_erase, slot, id_slot))
        path = Path(folder) / name
        work = _save if action == "save" else _restore
        return JSONResponse(await run_in_threadpool(work, slot, id_slot, path, name))

    async def apply_template(self, request: Request):
        """POST /apply-template {"messages", ...}: {"prompt": the chat template's text}."""
        body = await A._body(request, self.state, P.ChatCompletionRequest)
        slot = await self.state.acquire(body.model, body.keep_alive_seconds(), check=A.has_chat_template)
        try:
            prompt = await run_in_threadpool(render_chat, slot, body, self.state.config.reasoning_budget)
        finally:
            self.state.pool.release(slot)
        return JSONResponse({"prompt": prompt})


def error_body(err: P.APIError) -> dict:
    """The error object of a stream's last event."""
    return json.loads(error_response("", err).body)


def render_chat(slot, body: P.ChatCompletionRequest, reasoning_budget: int) -> str:
    """The text the model's chat template makes of a chat request with the generation prompt
    (what /v1/chat/completions tokenizes). Raises APIError (400): no template, its own error."""
    from edge.chat_template import ChatTemplateError
    from edge.server import thinking

    engine = slot.engine
    if engine.template is None:
        raise P.APIError(400, f"model {slot.name!r} has no chat template", param="messages", code="no_chat_template")
    _, tools, _ = body.tool_setup()
    messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text(), **m.template_fields()}
                for m in body.messages]
    variables = thinking.template_variables(body, engine.tokenizer, reasoning_budget)
    if tools:
        variables["tools"] = tools
    try:
        return engine.template.render(messages, add_generation_prompt=True, **variables)
    except ChatTemplateError as e:
        raise P.APIError(400, str(e), param="messages", code="chat_template_error") from None


# ---- slots ------------------------------------------------------------------------------------

def _check_filename(name: str) -> None:
    """Raise APIError (400 "Invalid filename") unless ``name`` is a plain file name: no
    directory part, not hidden, no control characters, at most 255 bytes."""
    bad = (not name or len(name.encode()) > 255 or name.startswith(".") or name != name.strip()
           or any(c in name for c in "/\\:") or any(ord(c) < 32 or ord(c) == 127 for c in name))
    if bad:
        raise P.APIError(400, "Invalid filename: a plain file name in --slot-save-path (no directory, not "
                              "starting with a dot)", param="filename", code="invalid_value")


def _slot_states(slot) -> list[dict]:
    """llama-server's /slots entries of a model's KV sequence slots."""
    engine, scheduler = slot.engine, slot.scheduler
    tok = engine.tokenizer
    running = {gen.slot: (req, gen) for req, gen in scheduler.running() if gen.slot is not None}
    out = []
    for i in range(engine.kv.n_seq):
        entry = {"id": i, "id_task": -1, "n_ctx": engine.n_ctx, "speculative": engine.speculator is not None,
                 "is_processing": i in running}
        if i in running:
            req, gen = running[i]
            prompt, tokens, n_cached, n_computed = gen.prompt_ids, list(gen.tokens), gen.n_cached, \
                int(engine.kv.pos[i])
        elif i in scheduler.last:
            rec = scheduler.last[i]
            req, prompt, tokens, n_cached, n_computed = rec.req, rec.prompt_ids, rec.tokens, rec.n_cached, \
                rec.n_computed
        else:
            out.append(entry)
            continue
        generated = tok.decode(tokens[len(prompt):]).decode("utf-8", errors="replace")
        n_decoded = len(tokens) - len(prompt)
        max_tokens = req.max_tokens if req is not None else None
        entry |= {
            "n_prompt_tokens": len(prompt), "n_prompt_tokens_processed": max(0, min(n_computed, len(prompt)) - n_cached),
            "n_prompt_tokens_cache": n_cached,
            "params": params_json(req.params, max_tokens, req.stop, req.logprobs or 0, speculative=req.speculative)
            if req is not None else {},
            "next_token": [{"has_next_token": i in running, "has_new_line": "\n" in generated,
                            "n_remain": -1 if max_tokens is None else max(0, max_tokens - n_decoded),
                            "n_decoded": n_decoded}],
            "prompt": tok.decode(prompt, unparse_special=True).decode("utf-8", errors="replace"),
            "generated": generated,
        }
        out.append(entry)
    return out


def _held(scheduler, kv, id_slot: int) -> list[int]:
    """The token ids whose K/V slot ``id_slot`` holds or last held (computed ones only)."""
    for req, gen in scheduler.running():
        if gen.slot == id_slot:
            return list(gen.tokens[: int(kv.pos[id_slot])])
    rec = scheduler.last.get(id_slot)
    return list(rec.tokens[: rec.n_computed]) if rec is not None else []


def _probe(kv, tokens: list[int]) -> tuple[int, int]:
    """A temporary KV sequence over the longest prefix of ``tokens`` the prefix cache holds (a
    multiple of the block size, at most len - 1) plus one more token: (its slot, n_cached).
    Raises APIError (503) when no sequence slot or block is free."""
    return _sequence(kv, tokens[: (len(tokens) - 1) // kv.block_size * kv.block_size + 1])


def _save(slot, id_slot: int, path: Path, name: str) -> dict:
    """Save the K/V of the tokens slot ``id_slot`` holds or last held to ``path``, an edge
    session file (edge.session: with the logits after its last token). What the prefix cache
    still holds is copied, the rest computed again, n_batch rows a step, the scheduler's steps
    going on between them. Returns llama-server's answer (n_saved tokens, n_written bytes).
    Raises APIError: 400 when the slot has held nothing, 503 when no KV slot or block is
    free, 500 when the file cannot be written."""
    from edge.generate import Rows
    from edge.session import save_session
    from edge.threads import use_threads

    t0 = time.perf_counter()
    engine, scheduler = slot.engine, slot.scheduler
    kv, loop = engine.kv, scheduler.loop
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        raise P.APIError(400, "Invalid filename: a symbolic link", param="filename", code="invalid_value")
    use_threads(scheduler.threads or None)
    with STEP_LOCK:
        tokens = _held(scheduler, kv, id_slot)
        if not tokens:
            raise P.APIError(400, f"slot {id_slot} holds no prompt to save", code="empty_slot")
        seq, done = _sequence(kv, tokens)
    try:
        while done < len(tokens):
            chunk = tokens[done : done + loop.n_batch]
            rows = Rows(seq, chunk, int(done + len(chunk) == len(tokens)))
            with STEP_LOCK:
                loop.reserve(rows)
                logits = loop.step([rows])
            done += len(chunk)
        with STEP_LOCK:
            try:
                n_written = save_session(path, engine, seq, logits[-1])
            except OSError as e:
                raise P.APIError(500, f"cannot write {name}: {e}", code="write_failed") from None
    finally:
        with STEP_LOCK:
            kv.free(seq)
    return {"id_slot": id_slot, "filename": name, "n_saved": len(tokens), "n_written": n_written,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


def _sequence(kv, tokens: list[int]) -> tuple[int, int]:
    """A temporary KV sequence of ``tokens``: (its slot, tokens the prefix cache held). Raises
    APIError (503) when no sequence slot or block is free."""
    from edge.kv.blocks import NoFreeBlocks
    from edge.kv.cache import NoFreeSlot

    try:
        return kv.new_sequence(tokens)
    except (NoFreeSlot, NoFreeBlocks) as e:
        raise P.APIError(503, f"the KV cache is full ({e}); retry when a request has finished", code="busy",
                         headers={"Retry-After": "1"}) from None


def _restore(slot, id_slot: int, path: Path, name: str) -> dict:
    """Put the K/V of a file :func:`_save` wrote into the prefix cache (a request whose prompt
    starts with its tokens reuses them) and record them as slot ``id_slot``'s. Returns
    llama-server's answer (n_restored tokens, n_read bytes). Raises APIError: 400 for a
    missing file or one made with another model or KV type, 503 when no KV slot is free."""
    from edge.kv.blocks import NoFreeBlocks
    from edge.kv.cache import KVNoSpace, NoFreeSlot
    from edge.session import SessionError, load_session

    t0 = time.perf_counter()
    engine, scheduler = slot.engine, slot.scheduler
    if not path.is_file() or path.is_symlink():
        raise P.APIError(400, f"failed to restore slot {id_slot}: no file {name!r} in --slot-save-path",
                         param="filename", code="not_found")
    try:
        saved = load_session(path, engine)
    except (SessionError, OSError) as e:
        raise P.APIError(400, f"failed to restore slot {id_slot}: {str(e).replace(str(path), name)}",
                         param="filename", code="invalid_value") from None
    tokens = [int(t) for t in saved.tokens]
    with STEP_LOCK:
        try:
            seq = engine.kv.import_sequence(saved.tokens, saved.ks, saved.vs)
        except (NoFreeSlot, NoFreeBlocks, KVNoSpace) as e:
            raise P.APIError(503, f"the KV cache is full ({e}); retry when a request has finished", code="busy",
                             headers={"Retry-After": "1"}) from None
        engine.kv.free(seq)
        scheduler.last[id_slot] = SlotRecord(None, tokens, tokens, 0, len(tokens))
    return {"id_slot": id_slot, "filename": name, "n_restored": len(tokens), "n_read": path.stat().st_size,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


def _erase(slot, id_slot: int) -> dict:
    """Forget what slot ``id_slot`` last held: the prefix cache drops the blocks of its tokens
    that no running request holds (a shared prefix goes too), and /slots no longer lists them.
    Raises APIError 503 while the slot runs a request."""
    engine, scheduler = slot.engine, slot.scheduler
    kv = engine.kv
    with STEP_LOCK:
        if any(gen.slot == id_slot for _, gen in scheduler.running()):
            raise P.APIError(503, f"slot {id_slot} is processing a request; retry when it has finished",
                             code="busy", headers={"Retry-After": "1"})
        rec = scheduler.last.pop(id_slot, None)
        tokens = list(rec.tokens[: rec.n_computed]) if rec is not None else []
        if len(tokens) >= 2:
            seq, n_cached = _probe(kv, tokens)
            mgr = kv.manager
            tables = [mgr.block_table(seq, g)[: n_cached // kv.block_size].tolist() for g in range(len(mgr.groups))]
            kv.free(seq)
            for g, table in enumerate(tables):
                counts = mgr.ref_counts(g)
                mgr.forget_free_blocks(g, [b for b in table if b >= 0 and counts[b] == 0
                                           and mgr.block_hash(g, b) is not None])
    return {"id_slot": id_slot, "n_erased": len(rec.tokens) if rec is not None else 0}


def routes(h) -> list[Route]:
    """llama-server's native routes over app's handlers ``h``."""
    x = _Llama(h)
    return [
        Route("/completion", x.completion, methods=["POST"]),
        Route("/infill", x.infill, methods=["POST"]),
        Route("/props", x.props, methods=["GET"]),
        Route("/props", x.set_props, methods=["POST"]),
        Route("/slots", x.slots, methods=["GET"]),
        Route("/slots/{id_slot}", x.slot_action, methods=["POST"]),
        Route("/apply-template", x.apply_template, methods=["POST"]),
    ]
