"""The OpenAI-compatible HTTP server (serving guide section 1).

    atom serve [MODEL] [--host 0.0.0.0] [--port 8000] [--api-key KEY] [all EngineArgs]
    python -m atom.entrypoints.openai_server [MODEL] ...   (the same)

Start-up checks the port first (before the model loads) and reports any failure in one line
(the traceback with ``--log-level debug``). The engine core runs in its own process; this
process parses HTTP, tokenizes, detokenizes and streams. On SIGINT/SIGTERM uvicorn stops
accepting connections and lets in-flight requests finish (up to ``--shutdown-timeout``
seconds, then cancels them, which aborts them in the engine); the engine process is shut
down last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import atom
from atom.engine.arg_utils import EngineArgs
from atom.engine.async_llm import AsyncLLM
from atom.entrypoints.openai.metrics import ServerMetrics
from atom.entrypoints.openai.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, JSONRoute
from atom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from atom.entrypoints.openai.responses_protocol import ResponsesRequest
from atom.entrypoints.openai.serving_chat import OpenAIServingChat
from atom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from atom.entrypoints.openai.serving_engine import OpenAIError, engine_dead_error
from atom.entrypoints.openai.serving_responses import OpenAIServingResponses
from atom.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from atom.entrypoints.openai.stat_logger import StatLogger, log_stats_interval
from atom.entrypoints.openai.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("atom.entrypoints.openai_server")

DEFAULT_MAX_REQUEST_BODY_SIZE = 64 << 20
DEFAULT_MAX_QUEUED_REQUESTS = 4096
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the served name of the embedded default model


class StartupError(Exception):
    """The server cannot start; the message says why and which flag fixes it."""


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
              request_timeout: float | None = None, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, trust_request_chat_template: bool = False,
              log_stats_interval: float | None = None, enable_log_requests: bool = False,
              docs: bool = True, response_role: str = "assistant", return_tokens_as_token_ids: bool = False,
              exclude_tools_when_tool_choice_none: bool = False, store_responses: bool = False) -> FastAPI:
    """The FastAPI app; its lifespan logs the engine's stats every ``log_stats_interval``
    seconds (None: never) and shuts the engine down (``serve`` starts it before the port
    opens). The reasoning parser is the engine's (``--reasoning-parser``). ``docs``: FastAPI's
    /docs, /redoc and /openapi.json. ``response_role``, ``return_tokens_as_token_ids``,
    ``exclude_tools_when_tool_choice_none``: vLLM's flags of those names. ``store_responses``: keep
    /v1/responses' responses for ``previous_response_id`` (vLLM's VLLM_ENABLE_RESPONSES_API_STORE)."""
    metrics = ServerMetrics(served_model_names[0], engine.config.parallel_config.data_parallel_size)
    engine.finished_callbacks.append(metrics.observe_finished)
    # the chat endpoint's settings, the Responses API's too (it runs its requests through the chat's)
    chat_args = dict(enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                     reasoning_parser=engine.config.reasoning_parser, response_role=response_role,
                     exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none)
    serving_args = (engine, served_model_names, request_timeout, trust_request_chat_template,
                    return_tokens_as_token_ids)
    chat = OpenAIServingChat(*serving_args, **chat_args)
    responses = OpenAIServingResponses(*serving_args, **chat_args, store=store_responses)
    completion = OpenAIServingCompletion(engine, served_model_names, request_timeout,
                                         return_tokens_as_token_ids=return_tokens_as_token_ids)
    chat.log_requests = completion.log_requests = responses.log_requests = enable_log_requests
    tokenization = OpenAIServingTokenization(engine, served_model_names,
                                             trust_request_chat_template=trust_request_chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stats_task = (asyncio.create_task(StatLogger(engine).run(log_stats_interval))
                      if log_stats_interval is not None else None)  # fmt: skip
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            logger.info("shutting down the engine")
            await engine.shutdown()

    no_docs = {} if docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="atom OpenAI-compatible server", version=atom.__version__, lifespan=lifespan, **no_docs)
    app.state.served_model_names = served_model_names
    app.router.route_class = JSONRoute
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

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request):
        return await run_until_disconnect(raw_request, responses.create_response(request))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return await responses.retrieve_response(response_id)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await run_until_disconnect(raw_request, completion.create_completion(request))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest):
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return await tokenization.detokenize(request)

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

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) health check
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": atom.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        # the stats each replica sent with its latest step (or abort): a scrape never waits on a step
        for engine_index, stats in enumerate(await engine.get_replica_stats(fresh=False)):
            if stats is not None:
                metrics.set_engine_stats(engine_index, stats)
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
    # "resolve": --port is the HTTP port here, as in vLLM, replacing EngineArgs' --port
    parser = argparse.ArgumentParser(prog="atom serve", description="atom OpenAI-compatible server",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     conflict_handler="resolve")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF model directory or .gguf file (or --model; default: the embedded model)")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", type=str, default="0.0.0.0", help="bind address")
    parser.add_argument("--port", "--server-port", dest="http_port", type=int, default=8000,
                        help="HTTP port (--server-port: the seed guide's name)")
    parser.add_argument("--engine-port", dest="port", type=int, default=EngineArgs.port,
                        help="internal engine communication port (not the HTTP port)")
    # the environment's key is read in serve(), so that --help never prints it
    parser.add_argument("--api-key", type=str, default=None,
                        help="require 'Authorization: Bearer KEY' (default: $ATOM_API_KEY, else $VLLM_API_KEY; "
                             "/health, /ping, /version and /metrics stay open)")
    parser.add_argument("--served-model-name", type=str, nargs="+", default=None,
                        help=f"model names the API accepts (default: MODEL as given; {DEFAULT_MODEL_NAME} for the "
                             "embedded model)")
    parser.add_argument("--log-level", type=str, default="info", choices=["debug", "info", "warning", "error"],
                        help="atom's log level; debug also prints start-up tracebacks")
    parser.add_argument("--uvicorn-log-level", type=str, default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
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
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a request's own chat_template (vLLM's flag; refused by default: it runs on the "
                             "server)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto": parse tool calls out of the output (needs --tool-call-parser)')
    parser.add_argument("--tool-call-parser", type=str, default=None, choices=sorted(TOOL_PARSERS),
                        help="the format the model writes tool calls in (hermes: Qwen2.5/Qwen3, SmolLM2, Hermes)")
    parser.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help='tool_choice "none": leave the tools out of the prompt (by default the chat template '
                             "still shows them, as vLLM's)")
    parser.add_argument("--chat-template", type=str, default=None,
                        help="the chat template for every chat request (vLLM's flag): a file, or the Jinja template "
                             "itself; default: the tokenizer's")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line (throughput, running and waiting requests, KV-cache usage) "
                             "every VLLM_LOG_STATS_INTERVAL seconds (default 10)")
    parser.add_argument("--response-role", type=str, default="assistant",
                        help="the role of chat responses when the request starts a new turn (add_generation_prompt; "
                             "else the last message's role)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help='logprobs show tokens as "token_id:{id}" (a request\'s return_tokens_as_token_ids wins)')
    parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                        help="log each request's id and sampling parameters (INFO) and its prompt token ids (DEBUG)")
    _add_http_args(parser)
    return parser


def _add_http_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's HTTP front-end flags: CORS, TLS, a proxy's root path, the API docs; LoRA's refused."""
    parser.add_argument("--allowed-origins", type=json.loads, default=["*"], help="CORS origins (a JSON list)")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS methods (a JSON list)")
    parser.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS headers (a JSON list)")
    parser.add_argument("--ssl-keyfile", type=str, default=None, help="serve HTTPS with this key file")
    parser.add_argument("--ssl-certfile", type=str, default=None, help="serve HTTPS with this certificate file")
    parser.add_argument("--ssl-ca-certs", type=str, default=None, help="CA certificates file (client verification)")
    parser.add_argument("--root-path", type=str, default=None,
                        help="the path prefix a reverse proxy serves the API under")
    parser.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    for flag in ("--enable-lora", "--lora-modules"):  # vLLM's; refused in one line instead of "unrecognized"
        parser.add_argument(flag, nargs="*", action=_Unsupported, help=argparse.SUPPRESS)


class _Unsupported(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: LoRA adapters are not supported by atom")


def main(argv: list[str] | None = None) -> None:
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (e.g. --tool-call-parser hermes)")
    if args.skip_tokenizer_init:
        parser.error("--skip-tokenizer-init: the server needs the tokenizer (chat templates, text in and out)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # a start-up failure: one line, the traceback only when debugging
        logger.debug("start-up failed", exc_info=True)
        logger.error("%s", _one_line(e))
        sys.exit(1)


def serve(args: argparse.Namespace) -> None:
    try:
        stats_interval = None if args.disable_log_stats else log_stats_interval()
        chat_template = load_chat_template(args.chat_template)
    except ValueError as e:
        raise StartupError(str(e)) from e
    sock = _bind(args.host, args.http_port)  # before the model loads: a taken port fails at once
    try:
        config = EngineArgs.from_cli_args(args).create_engine_config()
    except FileNotFoundError as e:
        raise StartupError(f"{e}; give a local model directory or .gguf file as MODEL (or --model)") from e
    engine = AsyncLLM(config, max_queued_requests=args.max_queued_requests)
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template  # chat requests and /tokenize use it
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    api_key = args.api_key or os.environ.get("ATOM_API_KEY") or os.environ.get("VLLM_API_KEY")
    app = build_app(engine, names, api_key, args.max_request_body_size, args.request_timeout,
                    args.enable_auto_tool_choice, args.tool_call_parser, args.trust_request_chat_template,
                    stats_interval, args.enable_log_requests, docs=not args.disable_fastapi_docs,
                    response_role=args.response_role, return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                    exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                    store_responses=os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0") == "1")
    app.root_path = args.root_path or ""  # as vLLM's: paths with and without the prefix both route
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
                       allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)
    uv_config = uvicorn.Config(app, host=args.host, port=args.http_port, log_level=args.uvicorn_log_level,
                               access_log=not args.disable_uvicorn_access_log,
                               timeout_graceful_shutdown=args.shutdown_timeout, ssl_keyfile=args.ssl_keyfile,
                               ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs)
    server = _Server(uv_config, engine)
    server.run(sockets=[sock])
    if server.startup_error is not None:
        raise server.startup_error


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the template itself when it has Jinja's characters, else a file to
    read (as vLLM resolves it)."""
    if value is None or any(c in value for c in "{}\n"):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--chat-template {value}: looks like a file path, but it cannot be read "
                         f"({e.strerror})") from None


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}; choose another port with --port "
                           "(or the address with --host)") from e
    return sock


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
    text = lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"
    return text if isinstance(e, StartupError) else f"{type(e).__name__}: {text}"


class _Server(uvicorn.Server):
    """uvicorn's server, which starts the engine before it listens."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM):
        super().__init__(config)
        self.engine = engine
        self.startup_error: Exception | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await self.engine.start()
        except Exception as e:
            await self.engine.shutdown()
            self.startup_error = e
            return
        names = ", ".join(self.config.app.state.served_model_names)
        logger.info("serving %s on http://%s:%d", names, self.config.host, self.config.port)
        await super().serve(sockets)

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
