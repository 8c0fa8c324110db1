"""`arcjax.AsyncLLM`: the engine stepped by a background thread, for asyncio servers.

1. `AsyncLLM(model, **options)` builds the engine (`build_engine`) and starts one thread
   that owns it: it steps while any request is unfinished and sleeps otherwise.
2. `async for out in llm.generate(prompt, params, request_id=None)` queues the request
   (validated at once: a bad request raises here, typed) with a one-slot collector as its
   sink, then yields its outputs until the final one. `llm.submit(...)` queues at once,
   synchronously, and returns the outputs' async iterator (`RequestStream`).
3. Leaving the `async for` early (a break, a cancelled task: a client disconnect) aborts
   the request; the engine frees its KV blocks at the start of its next step at the latest.
4. `await llm.abort(request_id)`; `llm.shutdown()` stops the thread (aborting what is left).

NOTE: the engine thread never waits on a reader. Each request's outputs go into a
collector that holds one slot and merges at put time (vLLM's output collector): a reader
that fell behind finds one output for everything it missed (DELTA: the new text, token ids
and logprobs concatenated; CUMULATIVE: the newest, its `delta_text` the concatenation), so
a reader that stops reading holds one merged output, never a queue of copies, and the
event loop is woken once per slot fill, not once per output. If the engine dies
(`EngineDeadError`: see engine/engine.py), every waiting reader gets that error, later calls
raise it, and the thread ends; nothing spins.
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
from arcjax.engine.engine_config import EngineConfig
from arcjax.outputs import CompletionOutput, RequestOutput
from arcjax.errors import EngineDeadError, UnknownRequestError
from arcjax.lora.lora_request import LoRARequest
from arcjax.sampling_params import SamplingParams
from arcjax.sampling_params import RequestOutputKind

log = logging.getLogger(__name__)


class _Merged:
    """Outputs of one request the reader has not taken yet, merged as they arrive (O(new)
    per output); `result()` is the one output that stands for all of them."""

    def __init__(self, out: RequestOutput, delta: bool):
        self.newest, self.delta, self.count = out, delta, 1
        self.first = out
        self.deltas: list[str] = []
        # per completion: texts, token ids, logprob entries (or None), reasoning and
        # content deltas (None: not split)
        self.parts: dict[int, tuple[list, list, list | None, list | None, list | None]] = {}

    def add(self, out: RequestOutput) -> None:
        if self.count == 1:
            self._absorb(self.first)
        self._absorb(out)
        self.newest = out
        self.count += 1

    def _absorb(self, out: RequestOutput) -> None:
        self.deltas.append(out.delta_text)
        if self.delta:
            for c in out.outputs:
                texts, ids, entries, reasoning, content = self.parts.setdefault(
                    c.index, ([], [], [] if c.logprobs is not None else None,
                              [] if c.reasoning is not None else None,
                              [] if c.content is not None else None))
                texts.append(c.text)
                ids.extend(c.token_ids)
                if entries is not None and c.logprobs is not None:
                    entries.extend(c.logprobs)
                for parts, part in ((reasoning, c.reasoning), (content, c.content)):
                    if parts is not None and part is not None:
                        parts.append(part)

    def result(self) -> RequestOutput:
        if self.count == 1:
            return self.newest
        out, delta_text = self.newest, "".join(self.deltas)
        if not self.delta:
            return dataclasses.replace(out, delta_text=delta_text)
        def joined(parts):
            return None if parts is None else "".join(parts)

        comps = tuple(CompletionOutput(c.index, "".join(texts), tuple(ids), c.cumulative_logprob,
                                       entries, c.finish_reason, joined(reasoning),
                                       joined(content))
                      for c in out.outputs
                      for texts, ids, entries, reasoning, content in [self.parts[c.index]])
        return dataclasses.replace(out, text=comps[0].text, token_ids=comps[0].token_ids,
                                   delta_text=delta_text, outputs=comps,
                                   prompt_logprobs=self.first.prompt_logprobs)


class _Collector:
    """Hands one request's outputs from the engine thread to its reader (one slot)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delta: bool):
        self._loop, self._delta = loop, delta
        self._lock = threading.Lock()
        self._slot: _Merged | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        """The request's sink (engine thread). Raises RuntimeError when the reader's event
        loop is gone (the engine then ends the request)."""
        with self._lock:
            wake = self._slot is None
            if wake:
                self._slot = _Merged(out, self._delta)
            else:
                self._slot.add(out)
        if wake:
            self._loop.call_soon_threadsafe(self._ready.set)

    def fail(self, error: BaseException) -> None:
        """The reader's next `get` raises `error` (after any output still in the slot)."""
        with self._lock:
            self._error = error
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the reader's loop is closed: nobody waits
            pass

    async def get(self) -> RequestOutput:
        while True:
            with self._lock:
                slot, self._slot = self._slot, None
                error = self._error
            if slot is not None:
                return slot.result()
            if error is not None:
                raise error
            self._ready.clear()
            await self._ready.wait()


class RequestStream:
    """The outputs of one submitted request (`AsyncLLM.submit`), an async iterator that
    ends after the final output; `aclose()` before that aborts the request."""

    def __init__(self, llm: "AsyncLLM", request_id: str, collector: _Collector):
        self.llm, self.request_id, self._collector = llm, request_id, collector
        self.finished = self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        out = await self._collector.get()
        if out.finished:
            self.finished = True
            self.cancel()
        return out

    async def aclose(self) -> None:
        self.cancel()

    def cancel(self) -> None:
        """Stops the stream (synchronously); aborts the request unless it finished."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self.llm._abort_quietly(self.request_id)
        self.llm._forget(self._collector)


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
        self._lock = threading.Lock()
        self._collectors: set[_Collector] = set()
        # held by whoever decides admission (a server's queue limit) and submits in one go
        self.admission_lock = threading.Lock()
        self.step_errors = 0  # exceptions that escaped a step (each one killed the engine)
        self._thread = threading.Thread(target=self._loop, name="arcjax-engine", daemon=True)
        self._thread.start()

    # --- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    continue
                self.engine.run_step()
        except BaseException as e:  # noqa: BLE001  the engine is dead: tell every reader
            self.step_errors += 1
            error = e if isinstance(e, EngineDeadError) else self.engine.kill(
                f"the engine loop failed: {e!r}")
            log.error("engine stopped: %s", error.reason, exc_info=e)
            with self._lock:
                collectors = list(self._collectors)
            for c in collectors:
                c.fail(error)

    def _notify(self) -> None:
        self._wake.set()

    # --- requests (event-loop side) -------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None,
               request_id: str | None = None, priority: int = 0, *,
               lora_request: LoRARequest | None = None) -> "RequestStream":
        """Queues a request now, synchronously (call it from the event loop), and returns
        the async iterator of its outputs (`async for out in stream`); `await
        stream.aclose()` before its final output aborts the request. A server decides
        admission and queues in one step with it (no other coroutine runs in between).
        `priority`: smaller is served first (the scheduler's order, vLLM's convention).

        Raises:
          RequestError subclasses: a bad request. EngineDeadError: the engine is dead.
        """
        params = SamplingParams() if params is None else params
        delta = isinstance(params, SamplingParams) and (
            params.output_kind is RequestOutputKind.DELTA)
        collector = _Collector(asyncio.get_running_loop(), delta)
        with self._lock:
            self._collectors.add(collector)
        try:
            if self._stopping:
                raise EngineDeadError("AsyncLLM.shutdown() was called")
            rid = self.engine.add_request(prompt, params, request_id, sink=collector.put,
                                          priority=priority, lora_request=lora_request)
            if not self._thread.is_alive():  # stopped between the check and the add
                raise self.engine.dead or EngineDeadError("the engine thread has stopped")
        except BaseException:
            self._forget(collector)
            raise
        self._notify()
        return RequestStream(self, rid, collector)

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0, *,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yields this request's outputs (as `params.output_kind` says; `delta_text` is the
        new text in each) until the final one. Leaving early aborts the request.

        Raises:
          RequestError subclasses: a bad request (at the first iteration).
          EngineDeadError: the engine is dead, or died while this request ran.
        """
        stream = self.submit(prompt, params, request_id, priority, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def _forget(self, collector: "_Collector") -> None:
        with self._lock:
            self._collectors.discard(collector)

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except (UnknownRequestError, EngineDeadError):  # it finished meanwhile, or all did
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
        """Whether the engine serves (False once stopping, or dead)."""
        return self._thread.is_alive() and not self._stopping and self.engine.dead is None

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
        with self._lock:  # a reader of a request nobody will step now must not wait
            collectors = list(self._collectors)
        for c in collectors:
            c.fail(EngineDeadError("AsyncLLM.shutdown() was called"))

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
