"""The server's resident memory while one reader stalls on a long stream with logprobs.

1. A server (`python -m arcjax.serve`, a subprocess) starts on the packaged model, copied
   with a longer context (--max_model_len) so it can stream --tokens tokens; one short
   request warms it up.
2. One client sends a streaming /v1/completions request (--tokens tokens, --logprobs top
   entries each, EOS ignored) over a socket with a small receive buffer, reads the first
   chunk, then stops reading: the server's writes back up and its outputs wait in memory.
3. While the engine generates every token, the server's RSS (/proc/PID/status, VmRSS) is
   sampled; once /metrics shows no request running, the client reads the rest and checks
   that the stream ended with [DONE].
4. Reported: RSS when the stall began, its peak while stalled, the growth. --compare_root
   runs the same measurement with the server of another checkout of arcjax (e.g. the commit
   before outputs became deltas), side by side.

  python scripts/bench_stall.py --tokens=4000 --logprobs=5 --out=runs/stall.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StallConfig:
    tokens: int = 4000
    logprobs: int = 5
    max_model_len: int = 4200
    recv_buffer: int = 4096  # the stalled client's socket receive buffer (bytes)
    compare_root: str | None = None
    out: str | None = None


_TOKENS = flags.DEFINE_integer("tokens", 4000, "tokens the stalled stream generates")
_LOGPROBS = flags.DEFINE_integer("logprobs", 5, "top logprobs per token")
_MAX_LEN = flags.DEFINE_integer("max_model_len", 4200, "the server's max_model_len")
_RECV = flags.DEFINE_integer("recv_buffer", 4096, "the stalled client's SO_RCVBUF")
_COMPARE = flags.DEFINE_string("compare_root", None, "another arcjax checkout whose server "
                               "is measured the same way (side by side)")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")


def _long_context_model(max_len: int) -> str:
    """The packaged model, copied with max_position_embeddings >= max_len."""
    from arcjax.engine.build import default_model_path

    path = tempfile.mkdtemp(prefix="arcjax-stall-model-")
    for f in os.listdir(default_model_path()):
        src = os.path.join(default_model_path(), f)
        if os.path.isfile(src):
            shutil.copy(src, path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max(max_len, cfg["max_position_embeddings"])
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _running(url: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "arcjax_num_requests_running":
                return s.value
    raise RuntimeError("no running gauge")


def measure(cfg: StallConfig, model: str, root: str) -> dict:
    """One server (the arcjax under `root`), one stalled reader."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "arcjax.serve", model, f"--port={port}",
                             "--served-model-name=m", f"--max-model-len={cfg.max_model_len}",
                             "--block-size=16", "--max-num-seqs=8"], env=env, cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        httpx.post(url + "/v1/completions", timeout=600, json={  # warm-up (compiles)
            "model": "m", "prompt": "Hello", "max_tokens": 16, "logprobs": cfg.logprobs})
        body = json.dumps({"model": "m", "prompt": "def fibonacci(n):", "stream": True,
                           "max_tokens": cfg.tokens, "temperature": 0, "ignore_eos": True,
                           "logprobs": cfg.logprobs}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg.recv_buffer)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        first = sock.recv(256)  # the head and the first chunk; then the reader stalls
        base = peak = _rss_bytes(proc.pid)
        t0 = time.monotonic()
        samples = []
        while True:
            time.sleep(0.25)
            rss = _rss_bytes(proc.pid)
            peak = max(peak, rss)
            samples.append((round(time.monotonic() - t0, 2), rss))
            if _running(url) == 0 and time.monotonic() - t0 > 1:
                break
            if time.monotonic() - t0 > 1800:
                raise RuntimeError("the stream did not finish")
        generated_s = time.monotonic() - t0
        held = _rss_bytes(proc.pid)
        data = first
        sock.settimeout(120)
        while b"[DONE]" not in data[-64:]:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            data += chunk
        sock.close()
        return {"root": root, "rss_at_stall_mb": base / 1e6, "rss_peak_mb": peak / 1e6,
                "rss_after_generation_mb": held / 1e6, "growth_mb": (peak - base) / 1e6,
                "generation_s": generated_s, "stream_bytes": len(data),
                "done": b"[DONE]" in data, "samples": samples}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv):
    del argv
    from arcjax.bench.report import write_json

    cfg = StallConfig(tokens=_TOKENS.value, logprobs=_LOGPROBS.value,
                      max_model_len=_MAX_LEN.value, recv_buffer=_RECV.value,
                      compare_root=_COMPARE.value, out=_OUT.value)
    model = _long_context_model(cfg.max_model_len)
    roots = [ROOT] + ([os.path.abspath(cfg.compare_root)] if cfg.compare_root else [])
    results = []
    for root in roots:
        r = measure(cfg, model, root)
        results.append(r)
        print(f"{'this checkout' if root == ROOT else root}: RSS {r['rss_at_stall_mb']:.1f} MB "
              f"when the reader stalled, peak {r['rss_peak_mb']:.1f} MB (+{r['growth_mb']:.1f} "
              f"MB) while {cfg.tokens} tokens with {cfg.logprobs} logprobs were generated in "
              f"{r['generation_s']:.1f} s; stream complete: {r['done']}")
    write_json(cfg.out, cfg, results=results)

if __name__ == "__main__":
    app.run(main)
