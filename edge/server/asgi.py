"""The ASGI app of `edge serve`: edge.server.app's OpenAI handlers and model pool, and the
other APIs' routes built on them (Anthropic's, the Responses API, Ollama's, embeddings,
llama-server's native ones). A module of its own so that the adapters import the app module
and the app module imports none of them (no import loop)."""
from __future__ import annotations

import asyncio
import contextlib
import threading

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from edge.server import anthropic, embeddings, guard, llama_server, ollama, responses
from edge.server import protocol as P
from edge.server.app import RequestLog, ServerConfig, ServerState, _Handlers


def create_app(config: ServerConfig, load: bool = True) -> Starlette:
    """The ASGI app. With ``load``, the model loads on a thread at startup (/health answers
    503 until it is ready); the scheduler is stopped at shutdown after its requests finish."""
    state = ServerState(config)
    h = _Handlers(state)

    def respond(path: str, err: P.APIError) -> Response:
        """An error in the shape of the API ``path`` belongs to: llama-server's, Anthropic's or OpenAI's."""
        if llama_server.serves(path):
            return llama_server.error_response(path, err)
        return anthropic.error_response(path, err) if anthropic.serves(path) else guard.openai_error(path, err)

    async def on_error(request: Request, exc: Exception):
        if isinstance(exc, P.APIError):
            return respond(request.url.path, exc)
        if isinstance(exc, HTTPException):
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            msg = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
            return respond(request.url.path, P.APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)),
                                                         code=code))
        return respond(request.url.path, P.APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                    code="internal_error"))

    routes = [
        Route("/v1/chat/completions", h.chat, methods=["POST"]),
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        # llama-server's aliases: the OpenAI routes without /v1 (clients given base_url without it)
        Route("/chat/completions", h.chat, methods=["POST"]),
        Route("/completions", h.completions, methods=["POST"]),
        Route("/models", h.models, methods=["GET"]),
        Route("/v1/health", h.health, methods=["GET"]),
        Route("/tokenize", h.tokenize, methods=["POST"]),
        Route("/detokenize", h.detokenize, methods=["POST"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/metrics", h.metrics, methods=["GET"]),
        Route("/models/load", h.load_model, methods=["POST"]),
        Route("/models/unload", h.unload_model, methods=["POST"]),
        Route("/", h.root, methods=["GET", "HEAD"]),
        *anthropic.routes(h),
        *responses.routes(h),
        *ollama.routes(h, embeddings.ollama_routes),    # Ollama's API (/api/chat, /api/generate, /api/tags ...) over start_chat / start_completion
        *embeddings.routes(h),   # /v1/embeddings, /embedding(s) (Ollama's /api/embed: ollama.routes)
        *llama_server.routes(h),   # llama-server's /completion, /infill, /props, /slots, /apply-template
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if load:
            threading.Thread(target=state.load, name="edge-load", daemon=True).start()

        async def reaper():          # unloads the models idle past their keep-alive
            while True:
                await asyncio.sleep(1.0)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(state.pool.reap)

        task = asyncio.create_task(reaper())
        yield
        task.cancel()
        await run_in_threadpool(state.pool.stop)

    middleware = [Middleware(RequestLog, state=state, log=config.log_requests),
                  *guard.middleware(config.host, config.allowed_hosts, config.cors_origins, config.api_key, respond)]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={Exception: on_error, HTTPException: on_error, P.APIError: on_error})
    app.state.edge = state
    return app

