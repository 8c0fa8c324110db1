"""One response of `/v1/responses`: its output items, its typed event stream, its object.

`ResponseBuilder` reads the completion as it grows, through the chat path's tool-call
reader (`tool_calls.ToolCallStream` over the request's `ToolPlan` parser: plain content
when no tool is offered), and turns what is new into output items and events:

  response.created, response.in_progress                      (`start`)
  per text item:  response.output_item.added (a message), response.content_part.added,
                  response.output_text.delta ...
  per tool call:  response.output_item.added (a function_call),
                  response.function_call_arguments.delta ...
  at the end:     per item in order, response.output_text.done +
                  response.content_part.done + response.output_item.done (a message), or
                  response.function_call_arguments.done + response.output_item.done
                  (a call); then response.completed (finish "stop"), or
                  response.incomplete (the response "incomplete": max_output_tokens
                  reached, or "cancelled"), or response.failed (its `error` set)
                                                                         (`finish`)

Text that comes after a tool call opens a new message item, so items keep the order the
model wrote them in. Every event carries its `sequence_number`. A whole (non-streamed)
response is the same builder fed the final text once: both paths make the same items.
`conversation()` is the output as chat messages (an assistant message with its text and
`tool_calls`), what a later `previous_response_id` continues from.
"""

from __future__ import annotations

import json
import time
import uuid

from arcjax.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan

STATUS_OF_FINISH = {"stop": "completed", "tool_calls": "completed", "length": "incomplete",
                    "abort": "cancelled", "error": "failed"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: dict) -> str:
    """One server-sent event of the Responses stream (`event:` names its type)."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    """The output items and events of one response (see the module docstring).

    Args:
      response_id: the response's id ("resp_...").
      model: the served model's name.
      echo: the request fields the response object repeats (`ParsedResponses.echo`).
      tools: the request's tool plan (its parser reads the completion).
      created_at: Unix seconds; None = now.
    """

    def __init__(self, response_id: str, model: str, echo: dict, tools: ToolPlan,
                 created_at: int | None = None):
        self.id, self.model, self.echo = response_id, model, echo
        self.created_at = int(time.time()) if created_at is None else created_at
        self.tools = tools
        self._reader = ToolCallStream(tools.parser)
        self._text_so_far: list[str] = []
        self.items: list[dict] = []  # output items, in order (open ones "in_progress")
        self._open_message: int | None = None  # index in items of the message being written
        self._calls: dict[int, int] = {}  # the reader's call index -> index in items
        self.seq = 0
        self.status = "in_progress"
        self.error: dict | None = None
        self.usage: dict | None = None
        self.finish_reason: str | None = None

    # --- the response object -----------------------------------------------------------
    def response(self) -> dict:
        """The response object now (OpenAI's shape)."""
        incomplete = ({"reason": "max_output_tokens"} if self.status == "incomplete"
                      else None)
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "model": self.model, "status": self.status, "error": self.error,
                "incomplete_details": incomplete, "output": [dict(i) for i in self.items],
                "usage": self.usage, **self.echo}

    def conversation(self) -> tuple[dict, ...]:
        """The output as chat messages (text and tool calls of one assistant turn)."""
        text = "".join(p["text"] for i in self.items if i["type"] == "message"
                       for p in i["content"])
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        message = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return (message,)

    @property
    def output_text(self) -> str:
        return "".join(p["text"] for i in self.items if i["type"] == "message"
                       for p in i["content"])

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

    def update(self, delta: str, final: bool = False) -> list[dict]:
        """Reads `delta` (the completion's new text; `final`: nothing follows) and returns
        the events of what it adds."""
        self._text_so_far.append(delta)
        content, items, _ = self._reader.update("".join(self._text_so_far), final)
        events = []
        if content:
            events += self._add_text(content)
        for item in items:
            if "id" in item:  # a new call
                events += self._close_message()
                events += self._add_call(item)
            else:
                events += self._add_arguments(self._calls[item["index"]],
                                              item["function"]["arguments"])
        return events

    def _open_text_item(self) -> list[dict]:
        """A new message item and its one output_text part (empty)."""
        item = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        self.items.append(item)
        index = self._open_message = len(self.items) - 1
        added = self.event("response.output_item.added", output_index=index, item=dict(item))
        item["content"] = [_text_part("")]
        return [added, self.event("response.content_part.added", item_id=item["id"],
                                   output_index=index, content_index=0, part=_text_part(""))]

    def _add_text(self, text: str) -> list[dict]:
        events = self._open_text_item() if self._open_message is None else []
        index = self._open_message
        item = self.items[index]
        item["content"][0] = _text_part(item["content"][0]["text"] + text)
        events.append(self.event("response.output_text.delta", item_id=item["id"],
                                  output_index=index, content_index=0, delta=text,
                                  logprobs=[]))
        return events

    def _close_message(self) -> list[dict]:
        if self._open_message is None:
            return []
        index, self._open_message = self._open_message, None
        return self._message_done(index, "completed")

    def _message_done(self, index: int, status: str) -> list[dict]:
        item = self.items[index]
        item["status"] = status
        part = item["content"][0]
        return [self.event("response.output_text.done", item_id=item["id"],
                            output_index=index, content_index=0, text=part["text"],
                            logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=dict(part)),
                self.event("response.output_item.done", output_index=index,
                            item=dict(item))]

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
        """Closes every item and returns the last events: response.completed (its status
        "completed", "incomplete" or "cancelled") or response.failed (`error`)."""
        events = self.update("", final=True) if finish_reason != "error" else []
        self.finish_reason = finish_reason
        self.status = STATUS_OF_FINISH.get(finish_reason, "failed")
        if not self.items and self.status in ("completed", "incomplete"):
            events += self._open_text_item()  # an empty completion: one empty message
        item_status = "incomplete" if self.status == "incomplete" else "completed"
        for index, item in enumerate(self.items):
            if item["status"] != "in_progress":
                continue
            if item["type"] == "message":
                events += self._message_done(index, item_status)
            else:
                item["status"] = item_status
                events.append(self.event("response.function_call_arguments.done",
                                          item_id=item["id"], output_index=index,
                                          name=item["name"], arguments=item["arguments"]))
                events.append(self.event("response.output_item.done", output_index=index,
                                          item=dict(item)))
        self._open_message = None
        self.usage = usage
        if self.status == "failed":
            self.error = {"code": "server_error", "message": error or "generation failed"}
            return events + [self.event("response.failed", response=self.response())]
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return events + [self.event(kind, response=self.response())]


def responses_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """The Responses API's `usage` object."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}
