"""Times one schedule + commit pair of the pure planner, for each policy.

  1. Build a state with `running` decode-ready sequences and `waiting` queued prompts (by driving
     the planner itself, so the state is one a real run reaches).
  2. "same state": time schedule + commit from that one state, repeated (purity makes it exact).
  3. "rolling": time `steps` consecutive schedule + commit pairs starting from it; this includes
     garbage collection, which a decode step triggers by keeping one new token record per row.

With max_num_seqs = running the running set is full: every policy plans a 256-row decode step.
With a larger max_num_seqs, token_budget also admits ~4 prompts per step (a mixed step) and the
legacy policies plan prompt steps.

Each configuration runs with prefix caching off and on (--prefix_caching); the prompts share no
prefix, so "on" measures the bookkeeping (hashing and caching every block that fills).

Also timed, per caching setting: `add_request` into a state with `waiting` queued requests (a
burst of `--burst` arrivals, best of 20 bursts, microseconds per call), and an overlapped pair
(`advance` + `schedule` + the filling `commit`) beside the serial pair in the "same state" table.

Usage: python scripts/bench_scheduler.py [--policies=token_budget,alternate,prefill_first]
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

from absl import app, flags

import scheduler

_POLICIES = flags.DEFINE_list("policies", list(scheduler.POLICIES), "policies to time")
_RUNNING = flags.DEFINE_integer("running", 256, "decode-ready sequences")
_WAITING = flags.DEFINE_integer("waiting", 1024, "queued sequences")
_MAX_NUM_SEQS = flags.DEFINE_list("max_num_seqs", ["256", "512"],
                                  "max_num_seqs values: 256 = running set full (decode steps), "
                                  "larger = prompts admitted every step")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 512, "prompt length of every request")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 4096, "max_tokens (large: nobody finishes)")
_STAGGER = flags.DEFINE_boolean(
    "stagger", True, "vary prompt lengths (by up to 63 tokens) so rows open KV blocks on different "
    "steps; --nostagger makes every row open a block on the same step (the worst case)")
_REPEATS = flags.DEFINE_integer("repeats", 2000, "pairs timed per 'same state' figure")
_STEPS = flags.DEFINE_integer("steps", 200, "pairs in the 'rolling' figure")
_BURST = flags.DEFINE_integer("burst", 128, "arrivals per timed add_request burst")
_CACHING = flags.DEFINE_list("prefix_caching", ["false", "true"],
                             "enable_prefix_caching values to time (prompts share no prefix, so "
                             "'true' shows what hashing and caching full blocks costs)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    policies: tuple[str, ...]
    running: int
    waiting: int
    max_num_seqs: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    stagger: bool
    repeats: int
    steps: int
    prefix_caching: tuple[bool, ...] = (False, True)


def _request(i: int, bench: BenchConfig) -> scheduler.Request:
    length = bench.prompt_tokens - ((i * 37) % 64 if bench.stagger else 0)
    prompt = tuple(1 + (i * 31 + j) % 30000 for j in range(length))
    return scheduler.Request(request_id=i, prompt_token_ids=prompt, max_tokens=bench.max_tokens,
                             arrival_time=float(i))


def _step(state, config):
    plan = scheduler.schedule(state, config)
    state, _ = scheduler.commit(plan.state, plan, [1] * plan.num_sampled, 0.0)
    return state


def build_state(bench: BenchConfig, config: scheduler.SchedulerConfig) -> scheduler.SchedulerState:
    """`running` decode-ready sequences (admitted by token_budget) plus `waiting` queued ones."""
    fill = dataclasses.replace(config, policy="token_budget", max_num_seqs=bench.running)
    state = scheduler.SchedulerState.empty(config)
    for i in range(bench.running):
        state = scheduler.add_request(state, _request(i, bench))
    while state.waiting or state.partial:
        state = _step(state, fill)
    for i in range(bench.running, bench.running + bench.waiting):
        state = scheduler.add_request(state, _request(i, bench))
    return state


def time_pairs(state, config, repeats: int, *, materialize: bool = False,
               clock=time.perf_counter) -> tuple[float, float]:
    """(best, median) microseconds per schedule + commit from the same state, over 50 rounds.

    Rounds are short (a few ms), so on a shared CPU the best one is likely undisturbed: it is the
    figure to compare. `clock=time.thread_time` counts only CPU time this thread got (immune to
    being descheduled, not to cache or frequency effects of neighbours). With `materialize`, each
    pair also builds the flat token ids (as an engine feeding the model does).
    """
    rounds = []
    per_round = max(1, repeats // 50)
    for _ in range(50):
        start = clock()
        for _ in range(per_round):
            plan = scheduler.schedule(state, config)
            if materialize:
                plan.token_ids  # noqa: B018
            scheduler.commit(plan.state, plan, (1,) * plan.num_sampled, 0.0)
        rounds.append((clock() - start) / per_round * 1e6)
    return min(rounds), statistics.median(rounds)


def time_add_request(bench: BenchConfig, config: scheduler.SchedulerConfig,
                     burst: int) -> float:
    """Best-of-20 microseconds per `add_request` call: `burst` arrivals into a state holding
    `bench.waiting` queued requests (and nothing running)."""
    state = scheduler.SchedulerState.empty(config)
    for i in range(bench.waiting):
        state = scheduler.add_request(state, _request(i, bench))
    arrivals = [_request(bench.waiting + i, bench) for i in range(burst)]
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        s = state
        for request in arrivals:
            s = scheduler.add_request(s, request)
        best = min(best, (time.perf_counter() - start) / burst * 1e6)
    return best


def time_overlapped(state, config, repeats: int) -> float:
    """Best thread-CPU microseconds per overlapped pair from one state: a step in flight is
    advanced, the next planned, then the first committed (the filling commit)."""
    first = scheduler.schedule(state, config)
    rounds = []
    per_round = max(1, repeats // 50)
    for _ in range(50):
        start = time.thread_time()
        for _ in range(per_round):
            ahead = scheduler.advance(first.state, first)
            plan = scheduler.schedule(ahead, config)
            scheduler.commit(plan.state, first, (1,) * first.num_sampled, 0.0)
        rounds.append((time.thread_time() - start) / per_round * 1e6)
    return min(rounds)


def time_rolling(state, config, steps: int) -> tuple[float, str]:
    """Mean thread-CPU microseconds per pair over `steps` consecutive steps (garbage collection
    included), and the step kinds seen."""
    kinds = {}
    start = time.thread_time()
    for _ in range(steps):
        plan = scheduler.schedule(state, config)
        kinds[plan.kind] = kinds.get(plan.kind, 0) + 1
        state, _ = scheduler.commit(plan.state, plan, (1,) * plan.num_sampled, 0.0)
    elapsed = (time.thread_time() - start) / steps * 1e6
    return elapsed, ",".join(f"{k}:{v}" for k, v in sorted(kinds.items()))


def main(argv):
    del argv
    bench = BenchConfig(
        policies=tuple(_POLICIES.value), running=_RUNNING.value, waiting=_WAITING.value,
        max_num_seqs=tuple(int(v) for v in _MAX_NUM_SEQS.value), prompt_tokens=_PROMPT.value,
        max_tokens=_MAX_TOKENS.value, stagger=_STAGGER.value, repeats=_REPEATS.value,
        steps=_STEPS.value,
        prefix_caching=tuple(v.strip().lower() in ("true", "1", "on") for v in _CACHING.value))
    needed = (bench.running + bench.waiting) * -(-(bench.prompt_tokens + bench.max_tokens) // 16)
    print(f"{bench.running} running, {bench.waiting} waiting, prompts of {bench.prompt_tokens}"
          " tokens, max_num_batched_tokens 2048, block_size 16")
    print("us per schedule + commit pair. 'same state' repeats the pair from one state: best and"
          " median wall time of 50 rounds, and best thread CPU time; '+ token ids' also "
          "materializes plan.token_ids (CPU time); 'rolling' averages 'steps' consecutive pairs "
          "(CPU time; the running set grows when max_num_seqs > running)")
    for caching in bench.prefix_caching:
        config = scheduler.SchedulerConfig(num_blocks=needed, enable_prefix_caching=caching)
        us = time_add_request(bench, config, _BURST.value)
        print(f"add_request with {bench.waiting} waiting, prefix caching "
              f"{'on' if caching else 'off'}: {us:.1f} us per call (best of 20 bursts of "
              f"{_BURST.value}; {us * _BURST.value / 1e3:.2f} ms per burst)")
    print(f"{'policy':<14} {'cache':>5} {'max_num_seqs':>12} {'wall best':>9} {'median':>7} "
          f"{'cpu best':>8} {'+ token ids':>11} {'overlapped':>10} {'rolling':>8}  "
          f"first plan / rolling step kinds")
    for max_num_seqs, caching, policy in itertools.product(
            bench.max_num_seqs, bench.prefix_caching, bench.policies):
        config = scheduler.SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs,
                                           num_blocks=needed, enable_prefix_caching=caching)
        state = build_state(bench, config)
        first = scheduler.schedule(state, config)
        best, median = time_pairs(state, config, bench.repeats)
        cpu, _ = time_pairs(state, config, bench.repeats, clock=time.thread_time)
        with_tokens, _ = time_pairs(state, config, bench.repeats, materialize=True,
                                    clock=time.thread_time)
        overlapped = time_overlapped(state, config, bench.repeats)
        rolling, kinds = time_rolling(state, config, bench.steps)
        print(f"{policy:<14} {'on' if caching else 'off':>5} {max_num_seqs:>12} {best:>9.1f} "
              f"{median:>7.1f} {cpu:>8.1f} {with_tokens:>11.1f} {overlapped:>10.1f} "
              f"{rolling:>8.1f}  "
              f"{first.kind} ({first.num_seqs} rows, {first.num_tokens} tokens) / {kinds}")

if __name__ == "__main__":
    app.run(main)
