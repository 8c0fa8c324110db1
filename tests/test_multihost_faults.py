"""Multi-host failures reach every process: two processes joined by jax.distributed on
127.0.0.1 (one CPU device each, the tiny model split over both), three runs in the same
pair of processes (each run a fresh engine pair on its own key prefix; executables are
compiled once):

  1. the follower raises in its step: both stop with the same `EngineDeadError`;
  2. the leader raises in its step: the same, the follower learning it while it waits;
  3. the follower is killed (SIGKILL, inside its step): the leader's waiter gets
     `EngineDeadError` once the follower's heartbeat stands still (1.5 s here).

Every run is bounded: each process reports when it stopped, and the test asserts that it
was within seconds of the failure (never a per-step timeout).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GEOMETRY = dict(block_size=8, num_kv_blocks=64, max_model_len=128, max_num_seqs=4,
                attention_impl="xla", chunk_tile=16, max_num_batched_tokens=32,
                dtype="float32")
LIVENESS_S = 1.5
FAIL_AT_COMMIT = 4  # the failing process fails in its 4th commit of a run
RUNS = ("follower_raises", "leader_raises", "follower_killed")


def _run(model: str, pid: int, port: int) -> None:
    """One process of the pair: the three runs; prints one JSON line per run."""
    import arcjax
    import scheduler
    from arcjax.engine.build import build_engine
    from arcjax.engine.engine_config import EngineConfig
    from arcjax.parallel import CoordinatorTransport, StepSync, follow, initialize

    initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    config = EngineConfig.from_options(model, tensor_parallel_size=2, **GEOMETRY)
    real_commit = scheduler.commit
    for run in RUNS:
        engine = build_engine(config)
        engine.sync = StepSync(CoordinatorTransport(), pid, 2, prefix=f"test/{run}",
                               heartbeat_s=0.25, liveness_timeout_s=LIVENESS_S, timeout_s=60)
        engine.sync.start_heartbeat()
        failing = {"follower_raises": 1, "leader_raises": 0, "follower_killed": 1}[run]
        commits, report = [], {"run": run, "process": pid}

        def commit(*args, run=run, commits=commits, report=report, **kwargs):
            commits.append(1)
            if pid == failing and len(commits) == FAIL_AT_COMMIT:
                report["injected_at"] = time.time()
                if run == "follower_killed":
                    print(json.dumps(report), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected failure in process {pid}")
            return real_commit(*args, **kwargs)

        scheduler.commit = commit
        try:
            if pid == 0:  # the leader serves two requests
                for prompt in ([5, 6, 7, 8, 9], [9, 8, 7]):
                    engine.add_request(prompt, arcjax.SamplingParams(
                        max_tokens=40, temperature=0, ignore_eos=True))
                while engine.has_unfinished():
                    engine.step()
                report["error"] = None
            else:
                report["steps"] = follow(engine)
                report["error"] = None
        except arcjax.EngineDeadError as e:
            report.update(error=e.reason, stopped_at=time.time(),
                          dead_after=not engine.has_unfinished())
            try:
                engine.add_request([5, 6], arcjax.SamplingParams(max_tokens=2))
            except arcjax.EngineDeadError:
                report["later_call_raises"] = True
        finally:
            scheduler.commit = real_commit
        print(json.dumps(report), flush=True)
    os._exit(0)  # the peer is gone: skip jax.distributed's shutdown barrier


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failure_on_any_process_stops_every_process_with_the_same_error():
    from support.hf_models import tiny_model_dir

    model = tiny_model_dir("LlamaForCausalLM")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE),
                                           os.environ.get("PYTHONPATH", "")]))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, model, str(pid), str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for pid in (0, 1)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            outs.append((out, err, p.returncode))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    reports = {}
    for out, err, _ in outs:
        for line in out.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                reports.setdefault((r["run"], r["process"]), {}).update(r)
    assert outs[0][2] == 0, outs[0][1][-3000:]
    assert outs[1][2] == -signal.SIGKILL, outs[1][1][-3000:]  # killed in the last run
    for run in ("follower_raises", "leader_raises"):
        leader, follower = reports[(run, 0)], reports[(run, 1)]
        failing = follower if run == "follower_raises" else leader
        assert "injected failure" in leader["error"] and "commit failed" in leader["error"]
        assert leader["error"] == follower["error"]  # the same error on both processes
        for r in (leader, follower):
            assert r["dead_after"] and r["later_call_raises"]
            assert r["stopped_at"] - failing["injected_at"] < 5.0, (run, r)
    print("\nmulti-host failures:", {f"{run}/{p}": {k: r.get(k) for k in (
        "error", "injected_at", "stopped_at")} for (run, p), r in sorted(reports.items())})
    leader = reports[("follower_killed", 0)]
    killed_at = reports[("follower_killed", 1)]["injected_at"]
    assert "process 1" in leader["error"] and leader["later_call_raises"]
    assert leader["stopped_at"] - killed_at < LIVENESS_S + 5.0, leader


if __name__ == "__main__":
    _run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
