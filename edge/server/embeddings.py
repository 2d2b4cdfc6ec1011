"""Embeddings on `edge serve`: OpenAI's, llama-server's and Ollama's routes over edge.embedding.

Routes (:func:`routes`, :func:`ollama_routes`):

- ``POST /v1/embeddings`` (OpenAI's shape, llama-server's ``post_embeddings_oai``): ``input``
  as a string, a list of strings, a token list or a list of token lists; ``encoding_format``
  "float" (default) or "base64" (the little-endian float32 bytes, base64); ``dimensions``
  only as n_embd (edge does not shorten vectors: 400 otherwise); llama-server's
  ``embd_normalize`` (default 2, euclidean). Answers ``{"object": "list", "data": [{"object":
  "embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``.
  With ``--pooling none`` it is llama-server's 400 ("Pooling type 'none' is not OAI compatible").
- ``POST /embedding`` and ``POST /embeddings`` (llama-server's own ``post_embeddings``): the
  same inputs as ``input`` or ``content``; answers a list ``[{"index", "embedding": [[...]]}]``,
  one object per input whose ``embedding`` holds the pooled vector, or with pooling none one
  unnormalised vector per token (llama-server normalises only pooled vectors).
- ``POST /api/embed`` (Ollama): ``input`` a string or a list of strings, ``truncate`` (default
  true: an input past the context is cut to its first n_ctx tokens; false: 400 "the input length
  exceeds the context length"), ``dimensions`` (0 < d < n_embd: the first d values,
  normalised again, as Ollama does), ``options`` (ignored), ``keep_alive``. Answers
  ``{"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}``; euclidean
  normalised. No input (``""`` or ``[]``) loads the model and answers no embeddings.
- ``POST /api/embeddings`` (Ollama's older route): ``prompt`` -> ``{"embedding": [...]}``,
  not normalised (as Ollama's); an empty prompt loads the model.

Texts are tokenized as llama-server does (edge.embedding.tokenize); an input of no tokens is a
400 ("Input content cannot be empty", llama-server's words), as is an input longer than the
server's ``-c`` (``context_length_exceeded``) except Ollama's truncate. The pooling is
``--pooling`` or the model's (edge.embedding.default_pooling: the GGUF's pooling_type, else
"last"); Ollama's routes take the last token's vector where the pooling is "none", as Ollama's
runner does. Embeddings are served whatever the server was started with (llama-server needs
``--embeddings``; edge takes the flag and needs none).

The forward passes run on a worker thread in a scratch KV cache of their own (the scheduler's
sequences and prefix cache are untouched), each pass under edge.server.scheduler.STEP_LOCK, so
they take turns with the scheduler's generation steps; the model's lease is held until the
vectors are computed, so the model pool does not unload it meanwhile.
"""
from __future__ import annotations

import base64
import time
from typing import Annotated

import numpy as np
from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from edge.embedding import EmbeddingError, Embeddings, default_pooling, embed, normalize_vectors
from edge.generate import ContextLengthExceeded
from edge.server import protocol as P
from edge.server.scheduler import STEP_LOCK
from edge.threads import use_threads

__all__ = ["EmbeddingsBody", "compute", "ollama_routes", "routes"]

Input = str | Annotated[list[int], Field(min_length=1)] | list[str | Annotated[list[int], Field(min_length=1)]]
EMPTY_INPUT = "Input content cannot be empty"              # llama-server's message
NOT_OAI = "Pooling type 'none' is not OAI compatible. Please use a different pooling type"


class EmbeddingsBody(P._KeepAlive):
    """POST /v1/embeddings, /embeddings, /embedding: OpenAI's fields and llama-server's."""

    model: str | None = None
    input: Input | None = None
    content: Input | None = None                # llama-server's name on its own routes
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    embd_normalize: int = 2

    def inputs(self) -> list:
        """The inputs as a list (a string or one token list is one input). Raises APIError 400
        when neither input nor content is given, or no input is."""
        value = self.input if self.input is not None else self.content
        if value is None:
            raise P.APIError(400, '"input" or "content" must be provided', param="input", code="invalid_value")
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        if not value:
            raise P.APIError(400, "input: give at least one text or token list", param="input",
                             code="invalid_value")
        return list(value)


def _bad(e: Exception) -> P.APIError:
    """The client's 400 for an edge.embedding error or an input past the context."""
    if isinstance(e, ContextLengthExceeded):
        return P.APIError(400, f"an input has {e.n_prompt} tokens but the context size (n_ctx) is {e.n_ctx}; "
                               "shorten it or raise -c/--ctx-size", param="input", code="context_length_exceeded",
                          extra={"n_prompt_tokens": e.n_prompt, "n_ctx": e.n_ctx})
    if e.empty:
        return P.APIError(400, f"{EMPTY_INPUT} ({e})", param="input", code="invalid_value")
    param = {"normalize": "embd_normalize", "pooling": "model"}.get(e.param, e.param)
    return P.APIError(400, str(e), param=param, code="invalid_value")


def _compute(engine, inputs: list, pooling: str, normalize: int, truncate: bool, threads) -> Embeddings:
    """The embeddings on the calling worker thread (its numba thread count set first), each
    forward pass under STEP_LOCK."""
    use_threads(threads)
    return embed(engine, inputs, pooling, normalize, truncate, lock=STEP_LOCK)


async def compute(h, request: Request, model: str | None, inputs: list, normalize: int = 2, truncate: bool = False,
                  keep_alive="default", route: str = "native",
                  dimensions: int | None = None) -> tuple[Embeddings, object, float]:
    """(the embeddings of ``inputs``, the model's slot, the seconds its acquisition took) on the
    model a request names (None: the default), loaded by the model pool if needed.

    ``route``: "openai" refuses pooling none (llama-server's 400); "ollama" pools "none" as
    "last" (Ollama's runner); "native" serves it (per-token vectors, unnormalised).
    ``dimensions``: the size the client asked for (OpenAI's; None: any), checked against the
    model's n_embd before any work.
    Raises APIError: 400 (empty input, too long, bad token, bad embd_normalize, pooling none
    on the OpenAI route, dimensions other than n_embd), 404 for a model not served, 503
    while it loads.
    """
    state = h.state
    t0 = time.perf_counter()
    slot = await state.acquire(model, keep_alive, any_name=route != "ollama")
    acquired = time.perf_counter() - t0
    request.state.edge_model = slot.name
    try:
        engine = slot.engine
        n_embd = engine.model.args.n_embd
        if dimensions is not None and dimensions != n_embd:
            raise P.APIError(400, f"dimensions must be the model's embedding size {n_embd} (edge does not shorten "
                                  f"embeddings), got {dimensions}", param="dimensions", code="invalid_value")
        try:
            pooling = state.config.pooling or default_pooling(engine.gguf)
        except EmbeddingError as e:
            raise P.APIError(400, str(e), param="model", code="invalid_value") from None
        if pooling == "none":
            if route == "openai":
                raise P.APIError(400, NOT_OAI, param="input", code="invalid_value")
            if route == "ollama":
                pooling = "last"
            else:
                normalize = -1                  # llama-server normalises pooled vectors only
        if not truncate:
            from edge.server.app import _too_long_to_tokenize
            for item in inputs:
                if isinstance(item, str):
                    _too_long_to_tokenize(slot, len(item.encode()), "input")
        try:
            out = await run_in_threadpool(_compute, engine, inputs, pooling, normalize, truncate,
                                          state.config.threads)
        except (EmbeddingError, ContextLengthExceeded) as e:
            raise _bad(e) from None
        return out, slot, acquired
    finally:
        state.pool.release(slot)


def _float32_base64(v: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")


class _Routes:
    def __init__(self, h):
        self.h = h

    async def _body(self, request: Request) -> EmbeddingsBody:
        from edge.server.app import _body
        return await _body(request, self.h.state, EmbeddingsBody)

    async def openai(self, request: Request):
        """POST /v1/embeddings: OpenAI's request and answer (module docstring)."""
        body = await self._body(request)
        if body.encoding_format not in ("float", "base64"):
            raise P.APIError(400, f"encoding_format must be \"float\" or \"base64\", got {body.encoding_format!r}",
                             param="encoding_format", code="invalid_value")
        inputs = body.inputs()
        out, slot, _ = await compute(self.h, request, body.model, inputs, body.embd_normalize, False,
                                     body.keep_alive_seconds(), route="openai", dimensions=body.dimensions)
        b64 = body.encoding_format == "base64"
        data = [{"object": "embedding", "index": i, "embedding": _float32_base64(v) if b64 else v.tolist()}
                for i, v in enumerate(out.vectors)]
        n = out.total_tokens
        return JSONResponse({"object": "list", "data": data, "model": body.model or slot.name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def native(self, request: Request):
        """POST /embedding, /embeddings: llama-server's list of {"index", "embedding": [[...]]}."""
        body = await self._body(request)
        out, _, _ = await compute(self.h, request, body.model, body.inputs(), body.embd_normalize, False,
                                  body.keep_alive_seconds(), route="native")
        return JSONResponse([{"index": i, "embedding": np.atleast_2d(v).tolist()} for i, v in enumerate(out.vectors)])


def routes(h) -> list[Route]:
    """OpenAI's and llama-server's embedding routes over the server's handlers ``h``."""
    r = _Routes(h)
    return [Route("/v1/embeddings", r.openai, methods=["POST"]),
            Route("/embeddings", r.native, methods=["POST"]),
            Route("/embedding", r.native, methods=["POST"])]


# ---- Ollama's -------------------------------------------------------------------------------------

def ollama_routes(o) -> list[Route]:
    """Ollama's /api/embed and /api/embeddings over edge.server.ollama's handlers ``o``."""
    r = _OllamaRoutes(o)
    return [Route("/api/embed", r.embed, methods=["POST"]),
            Route("/api/embeddings", r.embeddings, methods=["POST"])]


def _ollama_bodies():
    from edge.server import ollama as O

    class EmbedBody(O._Body):
        model: str = ""
        input: str | list[str] | None = None
        truncate: bool = True
        dimensions: int = 0
        options: dict | None = None
        keep_alive: O.Number | str | None = None

    class EmbeddingsBody(O._Body):
        model: str = ""
        prompt: str = ""
        options: dict | None = None
        keep_alive: O.Number | str | None = None

    return EmbedBody, EmbeddingsBody


class _OllamaRoutes:
    """POST /api/embed and /api/embeddings (module docstring), errors in Ollama's shape."""

    def __init__(self, o):
        from edge.server import ollama as O

        self.o, self.O = o, O
        self.EmbedBody, self.EmbeddingsBody = _ollama_bodies()
        self.embed = O._ollama_errors(_OllamaRoutes._embed).__get__(self)
        self.embeddings = O._ollama_errors(_OllamaRoutes._embeddings).__get__(self)

    async def _read(self, request: Request, cls):
        from edge.server.app import _body

        data = await _body(request, self.o.state, _AsDict)
        return self.O._validate(cls, data)

    async def _loaded(self, body) -> None:
        """An empty request: load the model (Ollama's way to preload an embedding model)."""
        if not body.model:
            raise P.APIError(400, "model is required", param="model", code="invalid_value")
        await self.o._require(body.model, body.keep_alive)

    async def _run(self, request: Request, body, inputs: list, normalize: int, truncate: bool):
        O = self.O
        if not body.model:
            raise P.APIError(400, "model is required", param="model", code="invalid_value")
        keep = "default" if body.keep_alive is None else P.parse_keep_alive(body.keep_alive)
        try:
            return await compute(self.o.h, request, O.edge_name(body.model), inputs, normalize, truncate, keep,
                                 route="ollama")
        except P.APIError as e:
            if e.code == "model_not_found":
                raise P.APIError(404, f'model "{body.model}" not found, try pulling it first', param="model",
                                 code="model_not_found") from None
            if e.code == "context_length_exceeded":
                e.message = "the input length exceeds the context length"
            raise

    async def _embed(self, request: Request):
        O = self.O
        t0 = time.perf_counter()
        body = await self._read(request, self.EmbedBody)
        inputs = [body.input] if isinstance(body.input, str) and body.input else \
            list(body.input) if isinstance(body.input, list) else []
        if body.dimensions < 0:
            raise P.APIError(400, f"dimensions must be 0 or more, got {body.dimensions}", param="dimensions",
                             code="invalid_value")
        if not inputs:
            await self._loaded(body)
            return JSONResponse({"model": body.model, "embeddings": []})
        out, _, load_s = await self._run(request, body, inputs, 2, body.truncate)
        vectors = out.vectors
        if 0 < body.dimensions < vectors[0].shape[-1]:      # Ollama: cut, then normalise again
            vectors = [normalize_vectors(v[: body.dimensions], 2) for v in vectors]
        return JSONResponse({"model": body.model, "embeddings": [v.tolist() for v in vectors],
                             "total_duration": O._ns(time.perf_counter() - t0), "load_duration": O._ns(load_s),
                             "prompt_eval_count": out.total_tokens})

    async def _embeddings(self, request: Request):
        body = await self._read(request, self.EmbeddingsBody)
        if not body.prompt:
            await self._loaded(body)
            return JSONResponse({"embedding": []})
        out, _, _ = await self._run(request, body, [body.prompt], -1, False)
        return JSONResponse({"embedding": out.vectors[0].tolist()})


class _AsDict:
    """app._body's model class that keeps the parsed JSON object as it is."""

    @staticmethod
    def model_validate(data: dict) -> dict:
        return data
