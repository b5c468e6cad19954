"""The OpenAI-compatible HTTP server (serving guide section 1).

    python -m atom.entrypoints.openai_server --model PATH [--host 0.0.0.0] [--server-port 8000]
        [--api-key KEY] [all EngineArgs]

The engine core runs in its own process; this process parses HTTP, tokenizes, detokenizes
and streams. On SIGINT/SIGTERM uvicorn stops accepting connections and lets in-flight
requests finish (up to ``--shutdown-timeout`` seconds, then cancels them, which aborts them
in the engine); the engine process is shut down last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
from contextlib import asynccontextmanager

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom.engine.arg_utils import EngineArgs
from atom.engine.async_llm import AsyncLLM
from atom.entrypoints.openai.metrics import ServerMetrics
from atom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from atom.entrypoints.openai.serving_chat import OpenAIServingChat
from atom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from atom.entrypoints.openai.serving_engine import OpenAIError, engine_dead_error

logger = logging.getLogger("atom.entrypoints.openai_server")

# paths that work without the API key (probes and scrapers)
OPEN_PATHS = frozenset({"/health", "/metrics"})
DEFAULT_MAX_REQUEST_BODY_SIZE = 64 << 20
DEFAULT_MAX_QUEUED_REQUESTS = 4096


class BodySizeLimitMiddleware:
    """413 for a request body over ``limit`` bytes: at once if its Content-Length says so,
    else as soon as that much has arrived (a chunked upload)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await OpenAIError(self._message(), status=413).response()(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                # an HTTPException raised while the body is read becomes this response
                raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, counting_receive, send)

    def _message(self) -> str:
        return f"request body too large: the limit is {self.limit} bytes (--max-request-body-size)"


class _JSONRequest(Request):
    async def json(self):
        # msgspec parses a large body several times faster than the json module, and the
        # event loop waits while it does; json.loads takes what msgspec refuses (NaN, lone
        # surrogates...) so that the field validation can name the field at fault
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = msgspec.json.decode(body)
            except (msgspec.DecodeError, UnicodeDecodeError):
                self._json = json.loads(body)
        return self._json


class _Route(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(_JSONRequest(request.scope, request.receive))

        return route_handler


class ApiKeyMiddleware:
    """Bearer-token check as plain ASGI middleware (``BaseHTTPMiddleware`` would get in the
    way of streaming and of noticing client disconnects)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(auth, self.expected):
            error = OpenAIError("Incorrect API key provided.", status=401, code="invalid_api_key")
            return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, coro):
    """Run a handler, cancelling it if the client goes away first: a non-streaming request
    is otherwise only noticed as abandoned once it has finished generating."""
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    disconnected = watcher.done() and not watcher.cancelled()
    if handler.done() and not disconnected:
        return handler.result()
    logger.info("client disconnected; aborting %s", request.url.path)
    handler.cancel()
    await asyncio.gather(handler, return_exceptions=True)
    if not handler.cancelled() and handler.exception() is None:
        body = getattr(handler.result(), "body_iterator", None)
        if body is not None:  # a stream nobody will read: close it, which aborts its requests
            await body.aclose()
    return Response(status_code=499)


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors() or [{"msg": "invalid request", "loc": ()}]
    # each branch of a union (str | list[str] ...) reports; the one that is not a type
    # mismatch says what is wrong
    err = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    # loc: "body", field names, list indices, and union-branch tags such as "list[int]"
    parts = [p for p in err.get("loc", ()) if p != "body" and not (isinstance(p, str) and _is_type_tag(p))]
    names = [p for p in parts if isinstance(p, str)]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    message = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    return OpenAIError(f"{path}: {message}" if path else message, param=names[0] if names else None).response()


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict")


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return OpenAIError(str(exc.detail), status=exc.status_code, type=kind).response()


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error in %s", request.url.path, exc_info=exc)
    return OpenAIError(f"internal server error ({type(exc).__name__})", status=500,
                       type="internal_server_error").response()


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              max_request_body_size: int = DEFAULT_MAX_REQUEST_BODY_SIZE,
              request_timeout: float | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine (so the port opens once the model is
    loaded) and shuts it down."""
    metrics = ServerMetrics(served_model_names[0])
    engine.finished_callbacks.append(metrics.observe_finished)
    chat = OpenAIServingChat(engine, served_model_names, request_timeout)
    completion = OpenAIServingCompletion(engine, served_model_names, request_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            logger.info("shutting down the engine")
            await engine.shutdown()

    app = FastAPI(title="atom OpenAI-compatible server", lifespan=lifespan)
    app.router.route_class = _Route
    app.add_exception_handler(OpenAIError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, limit=max_request_body_size)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await run_until_disconnect(raw_request, chat.create_chat_completion(request))

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await run_until_disconnect(raw_request, completion.create_completion(request))

    @app.get("/v1/models")
    async def list_models():
        max_len = engine.config.model_config.max_model_len
        cards = [ModelCard(id=name, root=engine.config.model_config.model, max_model_len=max_len)
                 for name in served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/health")
    async def health():
        if not engine.is_healthy:
            return engine_dead_error(RuntimeError(engine.dead_reason)).response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        # the stats the core sent with its latest step (or abort): a scrape never waits on a step
        stats = await engine.get_stats(fresh=False)
        if stats is not None:
            metrics.set_engine_stats(stats)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/start_profile")
    async def start_profile():
        await _profile(engine.start_profile, "started")
        return {"status": "ok", "message": "profiler started"}

    @app.post("/stop_profile")
    async def stop_profile():
        await _profile(engine.stop_profile, "stopped")
        trace_dir = os.path.join(engine.config.torch_profiler_dir or "", "rank_0")
        return {"status": "ok", "message": f"profiler stopped; traces in {trace_dir}"}

    return app


async def _profile(action, what: str) -> None:
    try:
        await action()
    except RuntimeError as e:
        raise OpenAIError(f"profiler not {what}: {e}") from e


def make_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="atom OpenAI-compatible server",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--host", type=str, default="0.0.0.0", help="bind address")
    parser.add_argument("--server-port", type=int, default=8000,
                        help="HTTP port (--port is for internal engine communication)")
    parser.add_argument("--api-key", type=str, default=os.environ.get("ATOM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $ATOM_API_KEY; /health and "
                             "/metrics stay open)")
    parser.add_argument("--served-model-name", type=str, nargs="+", default=None,
                        help="model names the API accepts (default: the --model path)")
    parser.add_argument("--log-level", type=str, default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish on SIGINT/SIGTERM before being aborted")
    parser.add_argument("--max-request-body-size", type=int, default=DEFAULT_MAX_REQUEST_BODY_SIZE,
                        help="largest request body in bytes (413 beyond)")
    parser.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                        help="engine requests (n counts n) allowed to wait beyond --max-num-seqs; more get 503 "
                             "with Retry-After")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may run before it is aborted (504); default: no limit")
    EngineArgs.add_cli_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    if args.skip_tokenizer_init:
        parser.error("--skip-tokenizer-init: the server needs the tokenizer (chat templates, text in and out)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = EngineArgs.from_cli_args(args).create_engine_config()
    engine = AsyncLLM(config, max_queued_requests=args.max_queued_requests)
    names = args.served_model_name or [config.model_config.model]
    app = build_app(engine, names, args.api_key, args.max_request_body_size, args.request_timeout)
    logger.info("serving %s on http://%s:%d", ", ".join(names), args.host, args.server_port)
    config = uvicorn.Config(app, host=args.host, port=args.server_port, log_level=args.log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    _Server(config).run()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            # uvicorn re-raises SIGINT/SIGTERM after a graceful shutdown, which ends the
            # process "killed by signal" (and prints a KeyboardInterrupt on Ctrl-C); a clean
            # shutdown is a normal exit here
            getattr(self, "_captured_signals", []).clear()


if __name__ == "__main__":
    main()
