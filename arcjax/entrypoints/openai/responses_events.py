"""One response of `/v1/responses`: its output items, its typed event stream, its object.

`ResponseBuilder` reads the completion as it grows through the chat path's reader
(`chat_output.ChatOutputStream`: the engine's reasoning split, then the request's tool
plan over the content), and turns what is new into output items and events:

  response.created, response.in_progress                      (`start`)
  per reasoning item: response.output_item.added (a reasoning item),
                  response.content_part.added (reasoning_text), response.reasoning_text.delta
  per text item:  response.output_item.added (a message), response.content_part.added
                  (output_text), response.output_text.delta ...
  per tool call:  response.output_item.added (a function_call),
                  response.function_call_arguments.delta ...
  when an item ends (another kind starts, or at the end): response.reasoning_text.done or
                  response.output_text.done, response.content_part.done,
                  response.output_item.done; a call's
                  response.function_call_arguments.done + response.output_item.done
  at the end:     response.completed (finish "stop"), response.incomplete (status
                  "incomplete": max_output_tokens reached, or "cancelled"), or
                  response.failed (its `error` set)                    (`finish`)

Items keep the order the model wrote them in (reasoning, text, calls; text after a call
opens a new message). Every event carries its `sequence_number`. A whole (non-streamed)
response is the same builder fed the final output once: both paths make the same items.
`conversation()` is the output as chat messages (an assistant message with its text and
`tool_calls`), what a later `previous_response_id` continues from.
"""

from __future__ import annotations

import json
import time
import uuid

from arcjax.entrypoints.openai.chat_output import ChatOutputStream
from arcjax.entrypoints.openai.response_logprobs import ChoiceDelta
from arcjax.entrypoints.openai.tool_calls import ToolPlan

STATUS_OF_FINISH = {"stop": "completed", "tool_calls": "completed", "length": "incomplete",
                    "abort": "cancelled", "error": "failed"}
# an item that holds text: its content part's type and the events naming its text
_TEXT_KINDS = {"message": ("output_text", "response.output_text"),
               "reasoning": ("reasoning_text", "response.reasoning_text")}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: dict) -> str:
    """One server-sent event of the Responses stream (`event:` names its type)."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


def responses_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """The Responses API's `usage` object (reasoning tokens are not counted apart, nor are
    the tokens a prompt adds to the prefix cache: both read 0)."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def _part(kind: str, text: str) -> dict:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _new_item(kind: str) -> dict:
    if kind == "message":
        return {"id": new_id("msg"), "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
    return {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
            "content": []}


class ResponseBuilder:
    """The output items and events of one response (see the module docstring).

    Args:
      response_id: the response's id ("resp_...").
      model: the served model's name.
      echo: the request fields the response object repeats (`responses_protocol.echo`).
      tools: the request's tool plan (its parser reads the completion's content).
      created_at: Unix seconds; None = now.
    """

    def __init__(self, response_id: str, model: str, echo: dict, tools: ToolPlan,
                 created_at: int | None = None):
        self.id, self.model, self.echo = response_id, model, echo
        self.created_at = int(time.time()) if created_at is None else created_at
        self._reader = ChatOutputStream(tools)
        self.items: list[dict] = []  # output items, in order (open ones "in_progress")
        self._open: int | None = None  # index in items of the text item being written
        self._calls: dict[int, int] = {}  # the reader's call index -> index in items
        self.seq = 0
        self.status = "in_progress"
        self.error: dict | None = None
        self.usage: dict | None = None

    # --- the response object -----------------------------------------------------------
    def response(self) -> dict:
        """The response object now (OpenAI's shape)."""
        incomplete = ({"reason": "max_output_tokens"} if self.status == "incomplete"
                      else None)
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "model": self.model, "status": self.status, "error": self.error,
                "incomplete_details": incomplete, "output": [dict(i) for i in self.items],
                "usage": self.usage, **self.echo}

    def _joined(self, kind: str) -> str:
        return "".join(p["text"] for i in self.items if i["type"] == kind
                       for p in i["content"])

    def conversation(self) -> tuple[dict, ...]:
        """The output as chat messages (text and tool calls of one assistant turn)."""
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        message = {"role": "assistant", "content": self._joined("message")}
        if calls:
            message["tool_calls"] = calls
        return (message,)

    @property
    def output_text(self) -> str:
        return self._joined("message")

    # --- events ------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> dict:
        """One event of this response (its sequence number taken)."""
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self, status: str = "in_progress") -> list[dict]:
        """The stream's first events (the response as it begins)."""
        self.status = status
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def update(self, delta: ChoiceDelta) -> list[dict]:
        """Reads one delta of the completion (a whole completion is one delta with its
        finish reason) and returns the events of what it adds."""
        new = self._reader.update(delta)
        events = []
        if new.reasoning:
            events += self._add_text("reasoning", new.reasoning)
        if new.content:
            events += self._add_text("message", new.content)
        for item in new.tool_items:
            if "id" in item:  # a new call
                events += self._close_text()
                events += self._add_call(item)
            else:
                events += self._add_arguments(self._calls[item["index"]],
                                              item["function"]["arguments"])
        return events

    def _add_text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is not None and self.items[self._open]["type"] != kind:
            events += self._close_text()
        if self._open is None:
            events += self._open_text_item(kind)
        index = self._open
        item = self.items[index]
        item["content"][0] = _part(kind, item["content"][0]["text"] + text)
        events.append(self.event(f"{_TEXT_KINDS[kind][1]}.delta", item_id=item["id"],
                                 output_index=index, content_index=0, delta=text,
                                 **({"logprobs": []} if kind == "message" else {})))
        return events

    def _open_text_item(self, kind: str) -> list[dict]:
        """A new message or reasoning item and its one text part (empty)."""
        item = _new_item(kind)
        self.items.append(item)
        index = self._open = len(self.items) - 1
        added = self.event("response.output_item.added", output_index=index, item=dict(item))
        item["content"] = [_part(kind, "")]
        return [added, self.event("response.content_part.added", item_id=item["id"],
                                  output_index=index, content_index=0, part=_part(kind, ""))]

    def _close_text(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return self._text_done(index, "completed")

    def _text_done(self, index: int, status: str) -> list[dict]:
        item = self.items[index]
        item["status"] = status
        part = item["content"][0]
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [self.event(f"{_TEXT_KINDS[item['type']][1]}.done", item_id=item["id"],
                           output_index=index, content_index=0, text=part["text"], **extra),
                self.event("response.content_part.done", item_id=item["id"],
                           output_index=index, content_index=0, part=dict(part)),
                self.event("response.output_item.done", output_index=index, item=dict(item))]

    def _add_call(self, call: dict) -> list[dict]:
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
        self.items.append(item)
        index = len(self.items) - 1
        self._calls[call["index"]] = index
        events = [self.event("response.output_item.added", output_index=index,
                             item=dict(item))]
        return events + self._add_arguments(index, call["function"]["arguments"])

    def _add_arguments(self, index: int, delta: str) -> list[dict]:
        if not delta:
            return []
        item = self.items[index]
        item["arguments"] += delta
        return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=delta)]

    def finish(self, finish_reason: str | None, usage: dict | None,
               error: str | None = None) -> list[dict]:
        """Closes every item and returns the last events: response.completed (status
        "completed"), response.incomplete ("incomplete" or "cancelled") or
        response.failed (`error`). The output's last delta must have been read first."""
        self.status = STATUS_OF_FINISH.get(finish_reason, "failed")
        events = []
        if not self.items and self.status in ("completed", "incomplete"):
            events += self._open_text_item("message")  # an empty completion: one message
        item_status = "incomplete" if self.status == "incomplete" else "completed"
        for index, item in enumerate(self.items):
            if item["status"] != "in_progress":
                continue
            if item["type"] in _TEXT_KINDS:
                events += self._text_done(index, item_status)
            else:
                item["status"] = item_status
                events.append(self.event("response.function_call_arguments.done",
                                         item_id=item["id"], output_index=index,
                                         name=item["name"], arguments=item["arguments"]))
                events.append(self.event("response.output_item.done", output_index=index,
                                         item=dict(item)))
        self._open = None
        self.usage = usage
        if self.status == "failed":
            self.error = {"code": "server_error", "message": error or "generation failed"}
            return events + [self.event("response.failed", response=self.response())]
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return events + [self.event(kind, response=self.response())]
