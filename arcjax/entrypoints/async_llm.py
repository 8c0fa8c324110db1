"""`arcjax.AsyncLLM`: the engine stepped by a background thread, for asyncio servers.

1. `AsyncLLM(model, **options)` builds the engine (`build_engine`) and starts one thread
   that owns it: it steps while any request is unfinished and sleeps otherwise.
2. `async for out in llm.generate(prompt, params, request_id=None)` queues the request
   (validated at once: a bad request raises here, typed) with a sink that hands each output
   to this coroutine's event loop (`call_soon_threadsafe`), then yields them until the
   final one.
3. Leaving the `async for` early (a break, a cancelled task: a client disconnect) aborts
   the request; the engine frees its KV blocks at the start of its next step at the latest.
4. `await llm.abort(request_id)`; `llm.shutdown()` stops the thread (aborting what is left).

NOTE: the engine thread never waits on a consumer: outputs go into an unbounded asyncio
queue per request, so a slow reader delays only itself. A reader that fell behind gets one
output for everything queued (the newest, its `delta_text` the concatenation of the deltas
it replaces), as vLLM's output collector merges deltas: a busy server then formats one
chunk instead of several. A sink whose event loop is gone
gets its request aborted by the engine. An exception escaping a step (a bug) finishes every
unfinished request with reason "error" and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator

from arcjax.engine.build import build_engine
from arcjax.engine.config import EngineConfig
from arcjax.engine.outputs import RequestOutput
from arcjax.errors import UnknownRequestError
from arcjax.runtime.sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncLLM:
    """A model plus an engine stepped by a background thread (see the module docstring).

    Args:
      model: a Hugging Face-format directory; None = the packaged default model.
      **options: engine options, as for `arcjax.LLM` (`arcjax.EngineConfig`).
    """

    def __init__(self, model: str | os.PathLike | None = None, **options):
        self.engine_config = EngineConfig.from_options(model, **options)
        self.engine = build_engine(self.engine_config)
        self.tokenizer = self.engine.tokenizer
        self._wake = threading.Event()
        self._stopping = False
        self.step_errors = 0  # steps that raised (each finished its requests with "error")
        self._thread = threading.Thread(target=self._loop, name="arcjax-engine", daemon=True)
        self._thread.start()

    # --- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            if not self.engine.has_unfinished():
                self._wake.wait()
                continue
            try:
                self.engine.run_step()
            except Exception as e:  # noqa: BLE001  a bug in a step must not kill the server
                self.step_errors += 1
                log.exception("engine step failed")
                self.engine.fail_all(f"engine step failed: {e!r}")

    def _notify(self) -> None:
        self._wake.set()

    # --- requests (event-loop side) -------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields this request's outputs (`delta_text` is the text new in each) until the
        final one. Raises RequestError subclasses at once for a bad request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:  # engine thread
            loop.call_soon_threadsafe(queue.put_nowait, out)

        rid = self.engine.add_request(prompt, params, request_id, sink=sink)
        self._notify()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if not out.finished and not queue.empty():  # behind: merge what is queued
                    deltas = [out.delta_text]
                    while not out.finished and not queue.empty():
                        out = queue.get_nowait()
                        deltas.append(out.delta_text)
                    out = dataclasses.replace(out, delta_text="".join(deltas))
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._abort_quietly(rid)

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except UnknownRequestError:  # it finished meanwhile
            pass
        self._notify()

    async def abort(self, request_id: str) -> None:
        """Aborts an unfinished request; its generator then yields a final "abort" output.

        Raises:
          UnknownRequestError: no unfinished request has this id.
        """
        self.engine.abort(request_id)
        self._notify()

    # --- state ------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return self.engine.num_unfinished

    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stops the engine thread; requests still unfinished are aborted first."""
        if self._stopping:
            return
        for rid in self.engine.unfinished_ids():
            self._abort_quietly(rid)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.engine.has_unfinished() and self._thread.is_alive():
            if deadline is not None and time.monotonic() > deadline:
                break
            self._notify()
            self._thread.join(0.01)
        self._stopping = True
        self._notify()
        self._thread.join(timeout)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
