"""Load on the server's endpoints for scripts/bench_serve.py: a raw asyncio HTTP/1.1 client
(far lighter than httpx, so many streams measure the server, not the client) and the two
endpoint experiments.

1. `sse_events(url, path, body)`: one streaming POST, yielding (arrival time, event name,
   data) per server-sent event; `post_json` / `post_raw`: one whole POST.
2. `stream_user(url, path, body, user, is_token, usage)`: one streamed request recorded in
   a `StreamUser` (the time of every event that carries text, the token count its final
   event reports), for `/v1/completions`, `/v1/chat/completions` and `/v1/responses` alike
   (`ENDPOINTS` says how each one's events are read).
3. `responses_vs_chat`: the same burst (same messages, greedy, `ignore_eos`, the same
   token counts) streamed through `/v1/chat/completions` and `/v1/responses`, runs
   alternating which endpoint goes first.
4. `embeddings_beside_streams`: embeddings alone, N generating streams alone, and both at
   once: embedded tokens per second, and the streams' inter-token latency while the
   embedding clients run (the middle half of each run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit


@dataclasses.dataclass
class StreamUser:
    start: float = 0.0
    times: list[float] = dataclasses.field(default_factory=list)  # events carrying text
    tokens: int = 0  # what the final event's usage says
    error: str | None = None
    done: bool = False


async def _open(url: str, path: str, body: bytes):
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    writer.write(f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + body)
    head = await reader.readuntil(b"\r\n\r\n")
    return reader, writer, int(head.split(b" ", 2)[1]), b"transfer-encoding: chunked" in \
        head.lower()


async def _body_chunks(reader, chunked: bool) -> AsyncIterator[bytes]:
    while True:
        if chunked:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            if size == 0:
                return
            yield (await reader.readexactly(size + 2))[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                return
            yield data


async def sse_events(url: str, path: str, body: dict
                     ) -> AsyncIterator[tuple[float, str | None, bytes]]:
    """(arrival time, `event:` name or None, `data:` payload) of each event of one
    streaming POST. Raises RuntimeError for a status other than 200."""
    reader, writer, status, chunked = await _open(url, path, json.dumps(body).encode())
    try:
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read(300))!r}")
        buf = b""
        async for data in _body_chunks(reader, chunked):
            buf += data
            *events, buf = buf.split(b"\n\n")
            now = time.perf_counter()
            for event in events:
                name, payload = None, None
                for line in event.split(b"\n"):
                    if line.startswith(b"event: "):
                        name = line[7:].decode()
                    elif line.startswith(b"data: "):
                        payload = line[6:]
                if payload is not None:
                    yield now, name, payload
    finally:
        writer.close()


async def post_raw(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    """One whole POST of a ready body: (status, the response body)."""
    reader, writer, status, chunked = await _open(url, path, body)
    try:
        return status, b"".join([c async for c in _body_chunks(reader, chunked)])
    finally:
        writer.close()


async def post_json(url: str, path: str, body: dict) -> tuple[int, dict]:
    """One whole POST: (status, the decoded body)."""
    status, raw = await post_raw(url, path, json.dumps(body).encode())
    return status, json.loads(raw)


# How each endpoint's stream is read: (its path, does an event carry text, the final token
# count an event reports or None).
def _completion_text(obj) -> bool:
    return bool(obj.get("choices") and obj["choices"][0].get("text"))


def _chat_text(obj) -> bool:
    return bool(obj.get("choices") and obj["choices"][0].get("delta", {}).get("content"))


def _usage_tokens(obj) -> int | None:
    return obj["usage"]["completion_tokens"] if obj.get("usage") else None


def _responses_text(obj) -> bool:
    return obj.get("type") == "response.output_text.delta" and bool(obj.get("delta"))


def _responses_tokens(obj) -> int | None:
    if obj.get("type") in ("response.completed", "response.incomplete"):
        return obj["response"]["usage"]["output_tokens"]
    return None


ENDPOINTS = {"completions": ("/v1/completions", _completion_text, _usage_tokens),
             "chat": ("/v1/chat/completions", _chat_text, _usage_tokens),
             "responses": ("/v1/responses", _responses_text, _responses_tokens)}


async def stream_user(url: str, endpoint: str, body: dict, user: StreamUser) -> None:
    """One streamed request of `endpoint` (`ENDPOINTS`), recorded in `user`."""
    path, is_text, tokens_of = ENDPOINTS[endpoint]
    user.start = time.perf_counter()
    try:
        async for now, _, payload in sse_events(url, path, body):
            if payload == b"[DONE]":
                user.done = True
                continue
            obj = json.loads(payload)
            if is_text(obj):
                user.times.append(now)
            tokens = tokens_of(obj)
            if tokens is not None:
                user.tokens, user.done = tokens, True
    except (OSError, asyncio.IncompleteReadError, ValueError, RuntimeError) as e:
        user.error = repr(e)


def stream_body(endpoint: str, model: str, prompt: str, max_tokens: int) -> dict:
    """The same greedy request (EOS ignored) in each endpoint's shape."""
    common = {"model": model, "temperature": 0, "ignore_eos": True, "stream": True}
    if endpoint == "completions":
        return {**common, "prompt": prompt, "max_tokens": max_tokens,
                "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        return {**common, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    return {**common, "input": prompt, "max_output_tokens": max_tokens, "store": False}


async def run_users(bodies: list[tuple[str, dict]], url: str, window_s: float,
                    delay: float = 0.0) -> tuple[list[StreamUser], float, float]:
    """Every (endpoint, body) at once, after `delay`; stops at `window_s`."""
    users = [StreamUser() for _ in bodies]
    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(stream_user(url, ep, body, u))
             for (ep, body), u in zip(bodies, users)]
    await asyncio.wait(tasks, timeout=window_s)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return users, t0, time.perf_counter()


async def embed_clients(url: str, model: str, texts: list[str], clients: int, batch: int,
                        start: float, stop: float) -> dict:
    """`clients` loops, each POSTing `batch` texts to /v1/embeddings from clock `start` to
    `stop` (a request started before `stop` is counted when it ends)."""
    embedded, requests, errors, latencies = [0], [0], [], []

    async def one(k: int) -> None:
        i = k * batch
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        while time.perf_counter() < stop:
            chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
            i += batch * clients
            t = time.perf_counter()
            status, obj = await post_json(url, "/v1/embeddings", {"model": model,
                                                                 "input": chunk})
            latencies.append(time.perf_counter() - t)
            if status != 200:
                errors.append(obj)
                return
            embedded[0] += obj["usage"]["prompt_tokens"]
            requests[0] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(clients)))
    wall = time.perf_counter() - max(t0, start)
    return {"embedded_tokens": embedded[0], "requests": requests[0], "errors": len(errors),
            "first_error": errors[0] if errors else None, "wall_s": wall,
            "embed_tok_s": embedded[0] / wall if wall > 0 else None,
            "request_latency_p50_s": sorted(latencies)[len(latencies) // 2] if latencies
            else None}


def gaps_between(users: list[StreamUser], lo: float, hi: float) -> list[float]:
    """Inter-token gaps of every user whose earlier token arrived in [lo, hi)."""
    return [b - a for u in users for a, b in zip(u.times, u.times[1:]) if lo <= a < hi]


async def responses_vs_chat(url: str, model: str, prompt_sets: list[list[str]],
                            max_tokens: int, window_s: float,
                            metrics: Callable[[list, float, float], dict]) -> list[dict]:
    """Per prompt set, the burst through both endpoints, the order alternating; `metrics`
    reduces a run (`run_metrics` of the script)."""
    runs = []
    for rep, prompts in enumerate(prompt_sets):
        order = ("chat", "responses") if rep % 2 == 0 else ("responses", "chat")
        for endpoint in order:
            bodies = [(endpoint, stream_body(endpoint, model, p, max_tokens)) for p in prompts]
            users, t0, end = await run_users(bodies, url, window_s)
            runs.append({**metrics(users, t0, end), "label": endpoint, "target": "http",
                         "repeat": rep})
    return runs


async def embeddings_beside_streams(url: str, model: str, prompts: list[str],
                                    texts: list[str], *, streams: int, max_tokens: int,
                                    window_s: float, clients: int, batch: int) -> dict:
    """Three runs: embeddings alone, `streams` completions alone, both; embedding clients
    run in the middle half of the window (the streams decode there in steady state)."""
    bodies = [("completions", stream_body("completions", model, prompts[i % len(prompts)],
                                          max_tokens)) for i in range(streams)]
    out = {}
    now = time.perf_counter()
    out["embeddings_alone"] = await embed_clients(url, model, texts, clients, batch, now,
                                                  now + window_s / 2)
    for label, embed in (("streams_alone", False), ("streams_and_embeddings", True)):
        now = time.perf_counter()
        lo, hi = now + window_s / 4, now + 3 * window_s / 4
        load = asyncio.ensure_future(run_users(bodies, url, window_s))
        emb = (await embed_clients(url, model, texts, clients, batch, lo, hi)) if embed else None
        users, t0, end = await load
        gaps = sorted(gaps_between(users, lo, hi))
        tokens = sum(len(u.times) for u in users)
        out[label] = {
            "errors": sum(u.error is not None for u in users),
            "itl_p50_s": gaps[len(gaps) // 2] if gaps else None,
            "itl_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
            "gen_tok_s_middle": len(gaps) / (hi - lo),
            "gen_tok_s": tokens / (end - t0), "embeddings": emb}
    return out
