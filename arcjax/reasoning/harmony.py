"""OpenAI's harmony format (gpt-oss) read from generated text with its special tokens kept.

An assistant turn is a run of messages, each `[<|start|>assistant] <|channel|>CHANNEL
[ to=RECIPIENT] [<|constrain|>TYPE | TYPE] <|message|>BODY` ended by `<|end|>`, `<|call|>`
(a tool call) or `<|return|>` (the last one). The prompt ends with `<|start|>assistant`, so
the first message of an output starts at `<|channel|>`:

  <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>
  commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

Channels: `analysis` (reasoning), `commentary` (tool calls, with a recipient; without one,
a preamble for the user), `final` (the answer). `parse_messages(text, final)` returns the
messages whose header is complete and how far the text is decided (a body being written
is decided up to a trailing partial special token); both only grow with the text, so
`reasoning.openai_gptoss` (reasoning and content) and the `openai` tool parser (calls)
stream at every split point.
"""

from __future__ import annotations

import dataclasses
import re

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
SPECIALS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_TERMINATOR = re.compile("|".join(re.escape(t) for t in (*ENDS, START, CHANNEL)))
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
FINAL_MARKER = CHANNEL + "final" + MESSAGE  # where the answer starts (the reasoning gate)


@dataclasses.dataclass(frozen=True)
class HarmonyMessage:
    """One message: its channel and recipient (None: none given), the body's character
    range in the text, and whether its end token has come."""

    channel: str
    recipient: str | None
    body_start: int
    body_end: int
    complete: bool

    @property
    def is_reasoning(self) -> bool:
        return self.channel == "analysis"

    @property
    def is_content(self) -> bool:
        """The answer, or a preamble the model addresses to the user."""
        return self.channel == "final" or (self.channel == "commentary"
                                           and self.recipient is None)


def _header(text: str) -> tuple[str, str | None]:
    """(channel, recipient) of a header (the text before `<|message|>`)."""
    channel = ""
    at = text.rfind(CHANNEL)
    if at >= 0:
        rest = text[at + len(CHANNEL):]
        channel = re.split(r"\s|<\|", rest, maxsplit=1)[0]
    found = _RECIPIENT.search(text)
    return channel, (found.group(1) if found else None)


def _partial_special(text: str, end: int) -> int:
    """Characters at `text[:end]`'s end that may begin a special token."""
    at = text.rfind("<|", max(0, end - 12), end)
    if at < 0:
        return 1 if text.endswith("<", 0, end) else 0
    piece = text[at:end]
    return end - at if any(s.startswith(piece) for s in SPECIALS) else 0


def parse_messages(text: str, final: bool) -> tuple[list[HarmonyMessage], int, int]:
    """The messages of `text` so far. Returns (messages, decided, tail): `decided` is how
    far the text is classified (a header still being written, or a partial special token
    at the end, is not, unless `final`); `tail` is where text outside any message begins
    (text before a header that never got its `<|message|>`: content once final)."""
    messages, pos, n = [], 0, len(text)
    while pos < n:
        at = text.find(MESSAGE, pos)
        if at < 0:
            break
        channel, recipient = _header(text[pos:at])
        body = at + len(MESSAGE)
        end = _TERMINATOR.search(text, body)
        if end is None:
            stop = n if final else n - _partial_special(text, n)
            messages.append(HarmonyMessage(channel, recipient, body, max(body, stop), final))
            return messages, max(body, stop), n
        messages.append(HarmonyMessage(channel, recipient, body, end.start(), True))
        pos = end.end() if end.group() in ENDS else end.start()
    return messages, (n if final else pos), pos
