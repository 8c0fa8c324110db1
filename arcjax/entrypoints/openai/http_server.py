"""The HTTP plumbing of `arcjax serve` (api_server.py holds the app, serving_*.py the
endpoints): OpenAI-shaped error responses, an SSE response that always closes what it
streams, the client-disconnect watch, the trace fan-out shared by
servers of one engine, and the uvicorn server whose SIGTERM / SIGINT drains gracefully.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from arcjax.entrypoints.openai.responses import error_body


class HTTPError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)


def error_response(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def too_large(size: int, limit: int) -> HTTPError:
    return HTTPError(413, f"the request body has {size} bytes or more, more than the "
                          f"server's --max-request-bytes {limit}", "invalid_request_error",
                     "body", "request_too_large")


async def close_outputs(outputs, streams) -> None:
    """Ends a response's outputs: every request not finished is aborted (even when the
    output generator never started)."""
    try:
        await outputs.aclose()
    finally:
        for s in streams:
            s.cancel()


class EventStream(StreamingResponse):
    """A StreamingResponse that always closes its body iterator and then runs `on_close`,
    even if the body never started (a cancelled stream then aborts its requests at once,
    not when the generator is garbage collected)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                await self._on_close()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, coro):
    """`await coro`, unless the client disconnects first: then coro is cancelled and this
    returns (False, None). Otherwise (True, result)."""
    task = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        gone.cancel()
        raise
    gone.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return False, None


class TraceFanout:
    """`Engine.trace_sink` that calls several listeners (servers sharing one engine, and
    whoever listened before the first server came)."""

    def __init__(self, first=None):
        self._sinks = [first] if first is not None else []

    @classmethod
    def install(cls, engine) -> "TraceFanout":
        if not isinstance(engine.trace_sink, cls):
            engine.trace_sink = cls(engine.trace_sink)
        return engine.trace_sink

    def add(self, sink) -> None:
        self._sinks = [*self._sinks, sink]  # copy-on-write: the engine thread iterates

    def remove(self, sink) -> None:
        self._sinks = [s for s in self._sinks if s != sink]

    def __call__(self, record) -> None:
        for sink in self._sinks:
            sink(record)


def _uvicorn_server(server):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, with SIGTERM/SIGINT starting `OpenAIServer.drain` instead of closing
        the listener at once (a second signal exits at once)."""

        _loop: asyncio.AbstractEventLoop | None = None
        _shutdown_started = False

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):  # a signal handler: never re-raised at exit
            self.request_shutdown()

        def request_shutdown(self) -> None:
            """Starts the graceful shutdown (any thread)."""
            if self._shutdown_started or self._loop is None:
                self.should_exit = True
                self.force_exit = self._shutdown_started
                return
            self._shutdown_started = True
            server.draining = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

        async def _drain(self):
            try:
                await server.drain(server.config.shutdown_timeout)
            finally:
                self.should_exit = True

    cfg = server.config
    config = uvicorn.Config(server.app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                            timeout_keep_alive=30)
    return Server(config)


def build_server(server):
    """A uvicorn server for `server.app` whose `request_shutdown()` drains gracefully (also
    on SIGTERM/SIGINT when run in the main thread). Run it with `.run(sockets=...)`."""
    return _uvicorn_server(server)
