"""ASGI pieces of the HTTP server: the API-key check, the request-body size limit, and a
route class whose requests parse JSON with msgspec."""

from __future__ import annotations

import hmac
import json

import msgspec
from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom.entrypoints.openai.serving_engine import OpenAIError

# paths that work without the API key (probes and scrapers)
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


def _route_path(scope) -> str:
    """The request's path without ``--root-path`` (a reverse proxy may pass the prefix on)."""
    root, path = scope.get("root_path", ""), scope["path"]
    return path[len(root):] if root and path.startswith(root) else path


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


class JSONRequest(Request):
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


class JSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(JSONRequest(request.scope, request.receive))

        return route_handler


class ApiKeyMiddleware:
    """Bearer-token check as plain ASGI middleware (``BaseHTTPMiddleware`` would get in the
    way of streaming and of noticing client disconnects)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _route_path(scope) in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(auth, self.expected):
            error = OpenAIError("Incorrect API key provided.", status=401, code="invalid_api_key")
            return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)
