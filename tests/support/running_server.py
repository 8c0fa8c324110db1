"""An in-process OpenAI-compatible server for the serving tests (tests/test_serve.py,
tests/test_structured_serve.py): `RunningServer(api)` runs `build_server(api)` on a free
port of 127.0.0.1 in a daemon thread; the tiny byte-level-BPE Llama with a chat template,
the cache geometry its engines use, and the tool-calling chat template and tool of the
structured-output and Responses tests."""

from __future__ import annotations

import socket
import threading
import time

from support.hf_models import tiny_model_with_chat_template

GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
                attention_impl="auto", chunk_tile=16, max_num_batched_tokens=128)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + "
                 "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
TOOLS_TEMPLATE = (  # the Hermes/Qwen tool format, tersely (tests/test_structured_serve.py)
    "{%- if tools %}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}tool: <tool_response>{{ m.content }}</tool_response>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}assistant:"
    "{%- for tc in m.tool_calls %}<tool_call>"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}"
    "</tool_call>{%- endfor %}\n"
    "{%- else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}assistant:{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


def chat_model_dir() -> str:
    """The tiny byte-level-BPE Llama with a chat template added."""
    return tiny_model_with_chat_template(CHAT_TEMPLATE)


class RunningServer:
    """`build_server(api)` run in a daemon thread; `.url`, `.stop()`."""

    def __init__(self, api):
        from arcjax.entrypoints.openai.http_server import build_server

        self.api = api
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = build_server(api)
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    def stop(self, timeout: float = 30) -> None:
        self.uv.request_shutdown()
        self.thread.join(timeout)
        self.api.close()
