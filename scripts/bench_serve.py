"""The burst experiment over HTTP: an async load generator for any OpenAI-compatible server.

  1. Prompts: K deterministic P-word prompts (words from the tokenizer's vocabulary, --seed),
     as scripts/bench_burst.py builds them.
  2. Load: --mode=burst (K users at once) or --mode=poisson (--num_requests arrivals at
     --rate per second). Each user streams /v1/completions (greedy, ignore_eos, --max_tokens)
     and records the time of every chunk that carries text.
  3. Targets: --url (a running server), or --launch: for every --arms entry a fresh
     `python -m arcjax.serve` subprocess with that arm's scheduler options (plus an
     in-process AsyncLLM with the same options when --inprocess), each warmed by one
     unmeasured run of the same load, then --repeats measured runs.
  4. Per run: TTFT p50/p90/p99/max, inter-token latency p50/p99, the longest stall of a
     decoding user (open waits at the end included), users with a first token inside
     --window_s, throughput; for servers, the knob-engagement counters of /metrics before and
     after (for in-process runs, the engine trace's engagement over the run).
  5. --out JSON, --plot PNG (TTFT CDF and per-user timelines), a table on stdout.
  6. --hostile_mb=6: for servers, a small request's latency alone and while another client
     sends a 6 MB body, in alternating pairs (the event loop must not block on one request),
     for each of --hostile_kinds: `text` (a text prompt), `ids` (a prompt of token ids),
     `chat` (one chat message), `messages` (many short chat messages).
  7. --experiment=responses: the burst streamed through /v1/chat/completions and
     /v1/responses on one server (the first arm; same messages, greedy, ignore_eos), runs
     alternating which goes first: TTFT, ITL and throughput of each.
     --experiment=embeddings: a `--runner pooling` server; /v1/embeddings alone
     (--embed_clients loops of --embed_batch prompts), --streams generating streams alone,
     and both at once: embedded tokens/s and what the embeddings cost the streams' ITL
     (arcjax/bench/endpoint_load.py).

  python scripts/bench_serve.py --launch --inprocess --num_users=32 --prompt_words=256 \
      --arms=token_budget:budget=512,prefill_first,prefill_first:cap=4 \
      --compilation_cache_dir=runs/jax_cache --out=runs/serve/k32.json --plot=runs/serve/k32.png
  python scripts/bench_serve.py --url=http://127.0.0.1:8000 --mode=poisson --rate=4 \
      --num_requests=64
  python scripts/bench_serve.py --launch --experiment=responses --num_users=64 \
      --prompt_words=16 --max_tokens=64 --repeats=4 --arms=token_budget:budget=512
  python scripts/bench_serve.py --launch --experiment=embeddings --streams=64 \
      --prompt_words=64 --max_tokens=2000 --window_s=24 --arms=token_budget:budget=512
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arcjax.bench.endpoint_load import StreamUser, post_raw, stream_body, stream_user  # noqa: E402

_URL = flags.DEFINE_string("url", None, "a running OpenAI-compatible server (base URL)")
_MODEL_NAME = flags.DEFINE_string("model_name", None, "model id to send (default: the "
                                  "server's first /v1/models entry)")
_LAUNCH = flags.DEFINE_bool("launch", False, "start `python -m arcjax.serve` per arm")
_INPROCESS = flags.DEFINE_bool("inprocess", False, "also run every arm on an in-process "
                               "AsyncLLM with the same options (no HTTP)")
_MODEL = flags.DEFINE_string("model", None, "model dir for --launch/--inprocess (default: "
                             "the packaged model); also the tokenizer for the prompts")
_ARMS = flags.DEFINE_list("arms", ["token_budget:budget=512", "prefill_first",
                                   "prefill_first:cap=4"],
                          "--launch arms: policy[:key=value...] (scheduler.parse_arm)")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 4096, "budget of arms setting none")
_MODE = flags.DEFINE_enum("mode", "burst", ["burst", "poisson"], "arrival pattern")
_USERS = flags.DEFINE_integer("num_users", 32, "burst: K users at once")
_RATE = flags.DEFINE_float("rate", 4.0, "poisson: arrivals per second")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "poisson: how many arrivals")
_WORDS = flags.DEFINE_integer("prompt_words", 256, "P: words per prompt")
_NEW = flags.DEFINE_integer("max_tokens", 32, "tokens per user (greedy, EOS ignored)")
_WINDOW = flags.DEFINE_float("window_s", 120.0, "a run stops (and disconnects its users) "
                             "this long after it starts; TTFT counted inside it")
_REPEATS = flags.DEFINE_integer("repeats", 1, "measured runs per target (round-robin)")
_SEED = flags.DEFINE_integer("seed", 0, "prompt and arrival seed")
_BLOCK = flags.DEFINE_integer("block_size", 16, "--launch/--inprocess: tokens per KV block")
_BLOCKS = flags.DEFINE_integer("num_kv_blocks", 0, "KV blocks; 0 = room for every user")
_SEQS = flags.DEFINE_integer("max_num_seqs", 0, "0 = max(8, users)")
_WARMUP_ALL = flags.DEFINE_bool("warmup_all", True, "--launch/--inprocess: compile every "
                                 "bucket first (`arcjax serve --warmup`, runner.warmup()), so "
                                 "no measured run compiles")
_CACHE = flags.DEFINE_string("compilation_cache_dir", None, "JAX persistent compilation cache")
_SERVER_ROOT = flags.DEFINE_string("server_root", None, "--launch: run the server of another "
                                   "arcjax checkout (default: this one), e.g. to measure the "
                                   "hostile bodies before a change")
_HOSTILE_MB = flags.DEFINE_float("hostile_mb", 0.0, "servers: also time a small request "
                                  "alone and while another client sends a prompt of this "
                                  "many MB (0 = skip)")
_HOSTILE_REPEATS = flags.DEFINE_integer("hostile_repeats", 10, "pairs for --hostile_mb")
_HOSTILE_KINDS = flags.DEFINE_list("hostile_kinds", ["text"], "--hostile_mb bodies: text, ids, "
                                   "chat, messages")
_EXPERIMENT = flags.DEFINE_enum("experiment", "burst", ["burst", "responses", "embeddings"],
                                "burst: the arms' burst; responses: /v1/responses against "
                                "/v1/chat/completions; embeddings: /v1/embeddings alone and "
                                "beside --streams generating streams")
_STREAMS = flags.DEFINE_integer("streams", 64, "embeddings: generating streams")
_EMBED_CLIENTS = flags.DEFINE_integer("embed_clients", 4, "embeddings: concurrent clients")
_EMBED_BATCH = flags.DEFINE_integer("embed_batch", 16, "embeddings: inputs per request")
_OUT = flags.DEFINE_string("out", None, "write every run as JSON here")
_PLOT = flags.DEFINE_string("plot", None, "write the TTFT CDF and user timelines (PNG) here")


# --- load generators --------------------------------------------------------------------------
async def _http_user(url: str, model: str, prompt: str, user: StreamUser) -> None:
    """One streaming /v1/completions request (greedy, ignore_eos, usage in the last chunk)
    over the raw asyncio client of arcjax/bench/endpoint_load.py (far lighter than httpx,
    so 64 streams measure the server, not the load generator)."""
    await stream_user(url, "completions", stream_body("completions", model, prompt, _NEW.value),
                      user)


async def _inproc_user(llm, prompt: str, user: StreamUser) -> None:
    from arcjax import SamplingParams

    params = SamplingParams(max_tokens=_NEW.value, temperature=0, ignore_eos=True)
    user.start = time.perf_counter()
    async for out in llm.generate(prompt, params):
        if out.delta_text:
            user.times.append(time.perf_counter())
        if out.finished:
            user.tokens = len(out.token_ids)
            user.done = True


async def _post(url: str, body: bytes, path: str = "/v1/completions") -> tuple[int, float]:
    """One non-streaming POST of `path`: (status, seconds)."""
    t0 = time.perf_counter()
    status, _ = await post_raw(url, path, body)
    return status, time.perf_counter() - t0


def _hostile_body(kind: str, model: str, size: float) -> tuple[str, bytes]:
    """(path, body) of a hostile request of about `size` bytes."""
    words = "lorem ipsum dolor sit amet "
    text = words * int(size / len(words))
    if kind == "text":
        return "/v1/completions", json.dumps({"model": model, "prompt": text,
                                              "max_tokens": 2}).encode()
    if kind == "ids":
        return "/v1/completions", json.dumps({"model": model, "max_tokens": 2,
                                              "prompt": [7] * int(size / 3)}).encode()
    if kind == "chat":
        return "/v1/chat/completions", json.dumps({
            "model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": text}]}).encode()
    if kind == "messages":
        return "/v1/chat/completions", json.dumps({
            "model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}] * int(size / 32)}).encode()
    raise ValueError(f"--hostile_kinds: unknown kind {kind!r}")


async def _hostile(url: str, model: str) -> dict:
    """A small request's latency alone and while another client sends each
    --hostile_kinds body of --hostile_mb MB (sent 5 ms before it), in alternating pairs."""
    small = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2,
                        "temperature": 0}).encode()
    await _post(url, small)  # warm
    out = {}
    for kind in _HOSTILE_KINDS.value:
        path, big = _hostile_body(kind, model, _HOSTILE_MB.value * 1e6)
        alone, beside, big_runs = [], [], []
        for _ in range(_HOSTILE_REPEATS.value):
            alone.append((await _post(url, small))[1])
            hostile = asyncio.ensure_future(_post(url, big, path))
            await asyncio.sleep(0.005)
            beside.append((await _post(url, small))[1])
            big_runs.append(await hostile)
        med_alone, med_beside = statistics.median(alone), statistics.median(beside)
        out[kind] = {"big_body_bytes": len(big), "small_alone_s": alone,
                     "small_beside_s": beside, "small_alone_median_s": med_alone,
                     "small_beside_median_s": med_beside, "ratio": med_beside / med_alone,
                     "big_status_and_s": big_runs}
    return out


def _report_hostile(label: str, hostile: dict) -> None:
    for kind, h in hostile.items():
        print(f"{label}: small request alone {1000 * h['small_alone_median_s']:.1f} ms, beside "
              f"a {h['big_body_bytes'] / 1e6:.1f} MB {kind} body "
              f"{1000 * h['small_beside_median_s']:.1f} ms (x{h['ratio']:.2f}); the big one: "
              f"{h['big_status_and_s'][0]}")


def _arrivals(n: int) -> list[float]:
    if _MODE.value == "burst":
        return [0.0] * n
    import random

    rng = random.Random(_SEED.value)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(_RATE.value)
    return out


async def _run_load(prompts: list[str], one) -> tuple[list[StreamUser], float, float]:
    """Runs every user (`one(prompt, user)`) at its arrival; stops at the window's end."""
    users = [StreamUser() for _ in prompts]
    arrivals = _arrivals(len(prompts))
    t0 = time.perf_counter()

    async def arrive(i):
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        await one(prompts[i], users[i])

    tasks = [asyncio.ensure_future(arrive(i)) for i in range(len(prompts))]
    await asyncio.wait(tasks, timeout=_WINDOW.value)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return users, t0, time.perf_counter()


# --- metrics ---------------------------------------------------------------------------------
def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def run_metrics(users: list[StreamUser], t0: float, end: float) -> dict:
    ttft = [u.times[0] - u.start for u in users if u.times]
    itl = [b - a for u in users for a, b in zip(u.times, u.times[1:])]
    stalls = [max([b - a for a, b in zip(u.times, u.times[1:])] +
                  ([] if u.done else [end - u.times[-1]]), default=0.0)
              for u in users if u.times]
    tokens = sum(u.tokens or len(u.times) for u in users)
    last = max((u.times[-1] for u in users if u.times), default=end)
    return {
        "users": len(users), "errors": sum(u.error is not None for u in users),
        "first_error": next((u.error for u in users if u.error), None),
        "users_with_first_token_in_window": sum(t <= _WINDOW.value for t in ttft),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99), "ttft_max_s": max(ttft, default=None),
        "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
        "longest_stall_s": max(stalls, default=None),
        "tokens": tokens, "throughput_tok_s": tokens / (last - t0) if last > t0 else None,
        "wall_s": end - t0,
        "ttft_all_s": sorted(ttft),
        "timelines": [[round(t - t0, 5) for t in u.times] for u in users],
    }


def _scrape(url: str) -> dict[str, float]:
    """Knob, preemption and step counters from /metrics (empty if the server has none)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "arcjax_scheduler_knob_engaged_steps_total":
                out[s.labels["knob"]] = s.value
            elif s.name in ("arcjax_preemptions_total", "arcjax_engine_steps_total"):
                out[s.name.removeprefix("arcjax_").removesuffix("_total")] = s.value
    return out


# --- targets ---------------------------------------------------------------------------------
def _arm_options(spec: str, num_users: int, num_blocks: int) -> dict:
    import scheduler

    arm = scheduler.parse_arm(spec)
    opts = {"policy": arm.policy, "max_num_batched_tokens": _BUDGET.value,
            "block_size": _BLOCK.value, "num_kv_blocks": num_blocks,
            "max_num_seqs": _SEQS.value or max(8, num_users)}
    opts.update(arm.overrides)
    return opts


class ServerProcess:
    """`python -m arcjax.serve` with engine options, on a free port of 127.0.0.1."""

    def __init__(self, options: dict):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "arcjax.serve", *([_MODEL.value] if _MODEL.value else []),
               f"--port={self.port}", "--served-model-name=bench", "--shutdown-timeout=5",
               *(f"--{k.replace('_', '-')}={v}" for k, v in options.items())]
        if _CACHE.value:
            cmd.append(f"--compilation-cache-dir={_CACHE.value}")
        if _WARMUP_ALL.value:
            cmd.append("--warmup")
        root = (os.path.abspath(_SERVER_ROOT.value) if _SERVER_ROOT.value
                else os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(cmd, env=env, cwd=root)
        import httpx

        deadline = time.monotonic() + 1800
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {cmd}")
            time.sleep(0.2)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


async def _http_run(url: str, model: str, prompts: list[str]):
    return await _run_load(prompts, lambda p, u: _http_user(url, model, p, u))


def _measure_http(url: str, model: str, prompts: list[str], label: str) -> dict:
    before = _scrape(url)
    users, t0, end = asyncio.run(_http_run(url, model, prompts))
    after = _scrape(url)
    m = run_metrics(users, t0, end)
    m.update(label=label, target="http", url=url,
             knobs_before=before, knobs_after=after,
             knobs_delta={k: after[k] - before.get(k, 0) for k in after})
    return m


def _measure_inprocess(llm, prompts: list[str], label: str) -> dict:
    from scheduler.metrics import engagement

    first_step = llm.engine.num_steps

    async def go():
        return await _run_load(prompts, lambda p, u: _inproc_user(llm, p, u))

    users, t0, end = asyncio.run(go())
    records = [r for r in llm.engine.trace if r.index >= first_step]
    counts = engagement(records)
    counts["preemptions"] = sum(len(r.engaged.get("preempted") or ()) for r in records)
    counts["engine_steps"] = len(records)
    m = run_metrics(users, t0, end)
    m.update(label=label, target="inprocess", knobs_delta=counts)
    return m


WARMUP_SEED_OFFSET = 1000


def _prompt_sets() -> tuple[dict[int, list[str]], int]:
    """Prompts per run: the warm-up uses seed + 1000, repeat r seed + r, so no run finds its
    prompts in the prefix cache (the engine caches by content). Returns them and the longest
    prompt's token count."""
    from arcjax.bench.burst import burst_prompts, word_pool
    from arcjax.engine.build import default_model_path
    from arcjax.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(_MODEL.value or default_model_path())
    n = _USERS.value if _MODE.value == "burst" else _NUM_REQUESTS.value
    pool = word_pool(tok)
    seeds = [_SEED.value + WARMUP_SEED_OFFSET] + [_SEED.value + r for r in range(_REPEATS.value)]
    sets = {s: burst_prompts(pool, n, _WORDS.value, s) for s in seeds}
    longest = max(len(tok.encode(p)) for ps in sets.values() for p in ps)
    return sets, longest


# --- report ----------------------------------------------------------------------------------
def _fmt(x, unit="s"):
    if x is None:
        return "-"
    if unit == "s":
        return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"
    return f"{x:.1f}"


def table(runs: list[dict]) -> str:
    rows = [("TTFT p50", "ttft_p50_s"), ("TTFT p90", "ttft_p90_s"), ("TTFT p99", "ttft_p99_s"),
            ("TTFT max", "ttft_max_s"), ("ITL p50", "itl_p50_s"), ("ITL p99", "itl_p99_s"),
            ("longest decode stall", "longest_stall_s")]
    head = "| | " + " | ".join(f"{r['label']} ({r['target']})" for r in runs) + " |"
    lines = [head, "|" + "---|" * (len(runs) + 1)]
    for name, key in rows:
        lines.append(f"| {name} | " + " | ".join(_fmt(r[key]) for r in runs) + " |")
    lines.append("| throughput | " + " | ".join(
        f"{_fmt(r['throughput_tok_s'], '')} tok/s" for r in runs) + " |")
    lines.append("| first token in window | " + " | ".join(
        f"{r['users_with_first_token_in_window']} / {r['users']}" for r in runs) + " |")
    lines.append("| errors | " + " | ".join(str(r["errors"]) for r in runs) + " |")
    lines.append("| knobs engaged (steps) | " + " | ".join(
        ", ".join(f"{k}={int(v)}" for k, v in sorted(r.get("knobs_delta", {}).items())
                  if v and k in ("cap_deferred", "floor_held", "budget_full_at", "preemptions",
                                 "engine_steps", "tile_trimmed")) or "-"
        for r in runs) + " |")
    return "\n".join(lines)


def _run_arm(spec: str, options: dict, warm: list[str], reps: list[list[str]]) -> list[dict]:
    """One arm: a server subprocess (--launch) and/or an in-process AsyncLLM (--inprocess),
    both alive at once, both warmed, then their measured runs interleaved repeat by repeat
    so that their ratio is measured side by side on a noisy machine."""
    server = ServerProcess(options) if _LAUNCH.value else None
    llm = None
    runs = []
    try:
        if _INPROCESS.value:
            from arcjax import AsyncLLM

            llm = AsyncLLM(_MODEL.value, **options)
            if _WARMUP_ALL.value:
                llm.engine.runner.warmup()
        if server:
            _measure_http(server.url, "bench", warm, spec)  # warm-up (compiles)
        if llm:
            _measure_inprocess(llm, warm, spec)
        for rep, prompts in enumerate(reps):
            if server:
                runs.append({**_measure_http(server.url, "bench", prompts, spec), "repeat": rep})
            if llm:
                runs.append({**_measure_inprocess(llm, prompts, spec), "repeat": rep})
        if server and _HOSTILE_MB.value:
            hostile = asyncio.run(_hostile(server.url, "bench"))
            _report_hostile(spec, hostile)
            runs.append({"label": spec, "target": "hostile", **hostile})
    finally:
        if llm:
            llm.shutdown()
        if server:
            code = server.stop()
            for r in runs:
                if r["target"] == "http":
                    r["server_exit"] = code
    return runs


def _pair_ratios(runs: list[dict]) -> dict[str, list[float]]:
    """Per repeat, responses' throughput and TTFT p50 over chat's (the same prompts)."""
    by = {(r["repeat"], r["label"]): r for r in runs}
    out = {"throughput": [], "ttft_p50": []}
    for rep in sorted({r["repeat"] for r in runs}):
        resp, chat = by[(rep, "responses")], by[(rep, "chat")]
        out["throughput"].append(resp["throughput_tok_s"] / chat["throughput_tok_s"])
        out["ttft_p50"].append(resp["ttft_p50_s"] / chat["ttft_p50_s"])
    return out


def _endpoint_experiment(warm: list[str], reps: list[list[str]], per_user: int) -> dict:
    """--experiment=responses | embeddings on one server (--url, or --launch with the first
    arm's options). Returns what goes into --out."""
    from arcjax.bench import endpoint_load as load

    embeddings = _EXPERIMENT.value == "embeddings"
    rows = max(len(warm), _STREAMS.value if embeddings else 0)
    if embeddings:  # every embedding in flight holds a sequence slot beside the streams
        rows += _EMBED_CLIENTS.value * _EMBED_BATCH.value
    options = _arm_options(_ARMS.value[0], rows, _BLOCKS.value or per_user * rows + 8)
    if embeddings:
        options["runner"] = "pooling"
    else:  # both endpoints get the same prompts in a repeat: the second must not find them cached
        options["enable_prefix_caching"] = False
    server = ServerProcess(options) if _LAUNCH.value else None
    try:
        if server:
            url, model = server.url, "bench"
        else:
            import httpx

            url = _URL.value.rstrip("/")
            model = _MODEL_NAME.value or httpx.get(url + "/v1/models").json()["data"][0]["id"]
        if not embeddings:
            asyncio.run(load.responses_vs_chat(url, model, [warm], _NEW.value, _WINDOW.value,
                                               run_metrics))  # warm-up (compiles)
            runs = asyncio.run(load.responses_vs_chat(url, model, reps, _NEW.value,
                                                      _WINDOW.value, run_metrics))
            print(table(runs))
            for row in summarize(runs):
                print(f"{row['label']}: median over {row['repeats']}: TTFT p50 "
                      f"{_fmt(row['ttft_p50_s'])}, ITL p50 {_fmt(row['itl_p50_s'])}, "
                      f"throughput {_fmt(row['throughput_tok_s'], '')} tok/s")
            ratios = _pair_ratios(runs)
            for key, xs in ratios.items():
                print(f"responses / chat {key} per repeat: median {statistics.median(xs):.3f}, "
                      f"range {min(xs):.3f}-{max(xs):.3f}")
            return {"options": options, "runs": runs, "summary": summarize(runs),
                    "ratios": ratios}
        texts = [p for ps in reps for p in ps]
        asyncio.run(load.embeddings_beside_streams(  # warm-up (compiles)
            url, model, warm, warm, streams=_STREAMS.value, max_tokens=_NEW.value,
            window_s=min(_WINDOW.value, 8.0), clients=_EMBED_CLIENTS.value,
            batch=_EMBED_BATCH.value))
        result = asyncio.run(load.embeddings_beside_streams(
            url, model, reps[0], texts, streams=_STREAMS.value, max_tokens=_NEW.value,
            window_s=_WINDOW.value, clients=_EMBED_CLIENTS.value, batch=_EMBED_BATCH.value))
        print(json.dumps(result, indent=1))
        return {"options": options, "result": result}
    finally:
        if server:
            server.stop()


def summarize(runs: list[dict]) -> list[dict]:
    """Median TTFT p50 and throughput over the repeats of each (label, target)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["label"], r["target"]), []).append(r)
    out = []
    for (label, target), rs in groups.items():
        def med(key):
            xs = [r[key] for r in rs if r[key] is not None]
            return statistics.median(xs) if xs else None
        out.append({"label": label, "target": target, "repeats": len(rs),
                    "ttft_p50_s": med("ttft_p50_s"), "throughput_tok_s": med("throughput_tok_s"),
                    "itl_p50_s": med("itl_p50_s")})
    return out


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, 1 + len(runs))
    rows = -(-(1 + len(runs)) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    ax = flat[0]
    for r in runs:
        xs = r["ttft_all_s"]
        ax.step(xs, [(i + 1) / r["users"] for i in range(len(xs))], where="post",
                label=f"{r['label']} ({r['target']})")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of users")
    ax.set_title("TTFT CDF")
    ax.legend(fontsize=7)
    for ax, r in zip(flat[1:], runs):
        for u, times in enumerate(r["timelines"]):
            ax.plot(times, [u] * len(times), "|", markersize=3)
        ax.set_title(f"{r['label']} ({r['target']}) #{r.get('repeat', 0)}", fontsize=9)
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel("user")
    for ax in flat[1 + len(runs):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv):
    del argv
    if not (_URL.value or _LAUNCH.value or _INPROCESS.value):
        raise app.UsageError("give --url, --launch and/or --inprocess")
    if _CACHE.value:
        from arcjax.runtime.runner import enable_persistent_compilation_cache

        enable_persistent_compilation_cache(_CACHE.value)
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    sets, longest = _prompt_sets()
    warm = sets[_SEED.value + WARMUP_SEED_OFFSET]
    reps = [sets[_SEED.value + r] for r in range(_REPEATS.value)]
    per_user = -(-(longest + _NEW.value) // _BLOCK.value)
    if _EXPERIMENT.value != "burst":
        out = _endpoint_experiment(warm, reps, per_user)
        if _OUT.value:
            os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
            with open(_OUT.value, "w") as f:
                json.dump({"argv": sys.argv, "machine": f"{platform.machine()}, "
                           f"{os.cpu_count()} CPUs", "load_average": os.getloadavg(), **out},
                          f, indent=1)
        return
    num_blocks = _BLOCKS.value or per_user * len(warm) + 8
    runs: list[dict] = []
    started = time.time()
    if _URL.value:
        import httpx

        url = _URL.value.rstrip("/")
        model = _MODEL_NAME.value or httpx.get(url + "/v1/models").json()["data"][0]["id"]
        for rep, prompts in enumerate(reps):
            runs.append({**_measure_http(url, model, prompts, "server"), "repeat": rep})
        if _HOSTILE_MB.value:
            hostile = asyncio.run(_hostile(url, model))
            _report_hostile("server", hostile)
            runs.append({"label": "server", "target": "hostile", **hostile})
    for spec in (_ARMS.value if (_LAUNCH.value or _INPROCESS.value) else []):
        runs += _run_arm(spec, _arm_options(spec, len(warm), num_blocks), warm, reps)
    loads = [r for r in runs if r["target"] != "hostile"]
    print(table(loads))
    summary = summarize(loads)
    for row in summary:
        print(f"{row['label']} ({row['target']}): median over {row['repeats']} repeats: TTFT "
              f"p50 {_fmt(row['ttft_p50_s'])}, throughput {_fmt(row['throughput_tok_s'], '')} "
              f"tok/s")
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "mode": _MODE.value, "num_users": _USERS.value, "prompt_words": _WORDS.value,
            "longest_prompt_tokens": longest, "max_tokens": _NEW.value,
            "num_kv_blocks": num_blocks, "arms": _ARMS.value, "wall_s": time.time() - started,
            "argv": sys.argv, "summary": summary}
    if _OUT.value:
        os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
        with open(_OUT.value, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
    if _PLOT.value:
        plot(loads, _PLOT.value)


if __name__ == "__main__":
    app.run(main)
