"""`arcjax chat` driven through a pseudo-terminal: the progress line, two turns (the second
sees the first), /reset, /exit. The packaged model, greedy, a few tokens; the replies must
equal `LLM.chat` on the same conversations."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from arcjax import LLM, SamplingParams, default_model_path

ROOT = Path(__file__).resolve().parents[1]
GEOMETRY = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, chunk_tile=16,
                block_size=8, num_kv_blocks=96, attention_impl="auto")
FLAGS = [item for k, v in GEOMETRY.items() for item in (f"--{k.replace('_', '-')}", str(v))]
TURNS = ["def add(a, b):", "import os"]
MAX_TOKENS = 10


class Terminal:
    """A child process on a pseudo-terminal: `read_until(text)`, `send(line)`."""

    def __init__(self, argv: list[str]):
        self.master, slave = pty.openpty()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     cwd=ROOT, close_fds=True)
        os.close(slave)
        self.seen = ""

    def read_until(self, text: str, timeout: float) -> str:
        """Everything read up to and including the next `text` (after what was read)."""
        deadline = time.monotonic() + timeout
        start = len(self.seen)
        while text not in self.seen[start:]:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not select.select(
                    [self.master], [], [], 0)[0]:
                raise AssertionError(f"no {text!r} in {self.seen[start:]!r}")
            if select.select([self.master], [], [], min(left, 1.0))[0]:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    pass
        end = self.seen.index(text, start) + len(text)
        return self.seen[start:end].replace("\r\n", "\n")

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


def _reply(segment: str, line: str) -> str:
    """The reply in what the terminal showed after `line` was typed: its echo, the reply,
    a newline, the next prompt."""
    echoed = segment.index(line + "\n") + len(line) + 1
    return segment[echoed:].removesuffix("you> ").removesuffix("\n")


def test_two_turns_reset_and_exit_through_a_pty():
    term = Terminal([sys.executable, "-m", "arcjax.entrypoints.cli", "chat",
                     str(default_model_path()), "--max-tokens", str(MAX_TOKENS),
                     "--temperature", "0", *FLAGS])
    try:
        startup = term.read_until("you> ", timeout=600)
        assert "loading" in startup and "compiling the first steps" in startup
        assert "ready: /reset starts over, /exit leaves" in startup
        replies = []
        for line in TURNS:
            term.send(line)
            replies.append(_reply(term.read_until("you> ", timeout=300), line))
        term.send("/reset")
        assert "(conversation reset)" in term.read_until("you> ", timeout=60)
        term.send("/exit")
        assert term.proc.wait(60) == 0
    finally:
        term.close()
    llm = LLM(**GEOMETRY)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    first = [{"role": "user", "content": TURNS[0]}]
    text = llm.chat(first, greedy, use_tqdm=False)[0].text
    second = first + [{"role": "assistant", "content": text},
                      {"role": "user", "content": TURNS[1]}]
    assert replies == [text, llm.chat(second, greedy, use_tqdm=False)[0].text]
