"""KV memory by attention type and the host tier, side by side in one run:

  (a) hybrid KV cache groups vs one table, planner only (scheduler.schedule/commit, no model):
      a Gemma 3 shape (five sliding layers to one global, window 1024) serving R requests of
      N tokens: the most KV held at once, in layer-pages (a block of one group holds
      `num_slots` layers' pages; a single-table block holds every layer's), and how many
      N-token requests run at once in a fixed KV budget (what one table needs for R of them);
  (b) multi-turn chat replay through the engine (a tiny random model on this machine): C
      conversations of T turns, the device cache sized to hold 1/8 of the histories; TTFT
      p50 of turns 2+ and the prompt tokens computed, host tier (`kv_offloading_size`) on vs
      off; outputs must be identical. Each engine first replays other conversations of the
      same lengths, so no compilation falls inside the measured replay.

  python scripts/bench_kv.py --out=runs/kv.json
  python scripts/bench_kv.py --requests=4 --tokens=4096 --chat=False   # (a) only, quick
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import time

from absl import app

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arcjax.entrypoints.flags import config_from_flags, define_flags  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVBenchConfig:
    layers: int = 62  # Gemma 3 27B: 62 layers, every 6th global
    global_every: int = 6
    window: int = 1024
    requests: int = 16
    tokens: int = 16384  # prompt + output of each request
    output_tokens: int = 64
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    capacity_requests: int = 96  # offered at once (long outputs) to count how many fit
    chat: bool = True
    model: str = ""  # "" = the packaged default model
    conversations: int = 64
    turns: int = 8
    turn_tokens: int = 48
    answer_tokens: int = 8
    device_fraction: float = 0.125  # of all histories' blocks the device cache holds
    host_gib: float = 1.0
    chat_block_size: int = 16
    max_num_seqs: int = 64
    seed: int = 0
    out: str = ""


def gemma3_layout(cfg: KVBenchConfig):
    """The KV layout of a Gemma 3-shaped model (only its layer types matter here)."""
    from arcjax.model.kv_layout import kv_layout
    from arcjax.model.model_config import ModelConfig

    sliding = tuple((i + 1) % cfg.global_every != 0 for i in range(cfg.layers))
    model = ModelConfig(architecture="Gemma3ForCausalLM", vocab_size=8, hidden_size=8,
                        intermediate_size=8, num_layers=cfg.layers, num_heads=1,
                        num_kv_heads=1, head_dim=8, sliding_window=cfg.window,
                        sliding_layers=sliding)
    return kv_layout(model), kv_layout(model, hybrid=False)


def _drive(config, requests) -> dict:
    """Runs `requests` (all arrived) to the end; the most blocks held and sequences running."""
    import scheduler

    state = scheduler.SchedulerState.empty(config)
    for r in requests:
        state = scheduler.add_request(state, r)
    peak_blocks = peak_running = preempted = steps = 0
    while state.has_work():
        plan = scheduler.schedule(state, config)
        peak_blocks = max(peak_blocks, plan.state.pool.num_in_use)
        peak_running = max(peak_running, len(plan.state.decoding) + len(plan.state.partial))
        preempted += len(plan.preempted)
        state, _ = scheduler.commit(plan.state, plan, [1] * plan.num_sampled, 0.0)
        steps += 1
    return {"peak_blocks": peak_blocks, "peak_running": peak_running, "preempted": preempted,
            "steps": steps}


def _capacity(config, requests) -> dict:
    """Offers `requests` (long outputs) at once and plans until the cache first forces a
    preemption or everyone runs: the most sequences running together before that."""
    import scheduler

    state = scheduler.SchedulerState.empty(config)
    for r in requests:
        state = scheduler.add_request(state, r)
    running = steps = 0
    while state.waiting or state.partial:
        plan = scheduler.schedule(state, config)
        if plan.preempted:
            break
        running = max(running, len(plan.state.decoding) + len(plan.state.partial))
        state, _ = scheduler.commit(plan.state, plan, [1] * plan.num_sampled, 0.0)
        steps += 1
    return {"running": running, "steps": steps, "stopped_by": "preemption" if state.waiting
            else "all admitted"}


def hybrid_vs_single(cfg: KVBenchConfig) -> dict:
    """Part (a)."""
    import scheduler

    hybrid, single = gemma3_layout(cfg)
    prompt = cfg.tokens - cfg.output_tokens

    def requests(n, max_tokens=cfg.output_tokens):
        return [scheduler.Request(request_id=i, prompt_token_ids=tuple(
            1 + (i * 7919 + j) % 30000 for j in range(prompt)), max_tokens=max_tokens)
            for i in range(n)]

    per_request = -(-cfg.tokens // cfg.block_size)  # one table's blocks for one request
    roomy = cfg.requests * per_request * hybrid.num_groups + 1
    base = dict(block_size=cfg.block_size, max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=max(cfg.requests, cfg.capacity_requests), num_blocks=roomy)
    configs = {"one_table": scheduler.SchedulerConfig(**base),
               "hybrid": scheduler.SchedulerConfig(**base,
                                                   kv_cache_groups=hybrid.scheduler_groups)}
    pages = {"one_table": single.num_slots, "hybrid": hybrid.num_slots}
    out = {"layout": {"layers": cfg.layers, "groups": list(hybrid.group_windows),
                      "num_slots": hybrid.num_slots}}
    for name, config in configs.items():
        t0 = time.perf_counter()
        run = _drive(config, requests(cfg.requests))
        run["peak_layer_pages"] = run["peak_blocks"] * pages[name]
        run["wall_s"] = time.perf_counter() - t0
        out[name] = run
    out["peak_ratio_hybrid_over_one_table"] = (out["hybrid"]["peak_layer_pages"]
                                               / out["one_table"]["peak_layer_pages"])
    # capacity: the budget one table needs for `requests` requests at `tokens` each, offered
    # many more that keep generating
    budget_pages = cfg.requests * per_request * single.num_slots
    capacity = {}
    for name, config in configs.items():
        blocks = budget_pages // pages[name]
        sized = dataclasses.replace(config, num_blocks=blocks)
        capacity[name] = _capacity(sized, requests(cfg.capacity_requests, cfg.tokens))
        capacity[name]["num_blocks"] = blocks
    capacity["budget_layer_pages"] = budget_pages
    out["capacity"] = capacity
    return out


def _percentile(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


_SIZES = ("kv_blocks_in_use", "kv_blocks_total", "kv_host_blocks_total")  # not counters


def _replay(llm, new_tokens, params) -> tuple[list, list]:
    """Every turn of every conversation through `llm` (each turn's prompts resend the whole
    history plus its new tokens, in one batch): per-turn figures, and the answers."""
    conversations = len(new_tokens[0])
    histories = [[] for _ in range(conversations)]
    turns, answers = [], []
    for turn_tokens in new_tokens:
        prompts = [h + new for h, new in zip(histories, turn_tokens)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        prompt_tokens = sum(map(len, prompts))
        cached = sum(o.num_cached_tokens for o in outs)
        turns.append({"wall_s": wall, "prompt_tokens": prompt_tokens,
                      "prefill_tokens": prompt_tokens - cached,
                      "ttft_p50_s": _percentile([o.metrics.ttft for o in outs], 50)})
        answers.append([list(o.token_ids) for o in outs])
        histories = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
    return turns, answers


def chat_replay(cfg: KVBenchConfig) -> dict:
    """Part (b): the same conversations through two engines, host tier off and on. Each
    engine first replays other conversations of the same lengths (same plans, so the same
    step shapes and transfer counts): nothing compiles inside the measured replay."""
    import numpy as np

    import arcjax

    history_tokens = cfg.turns * (cfg.turn_tokens + cfg.answer_tokens)
    per_history = -(-history_tokens // cfg.chat_block_size)
    device_blocks = max(per_history * 2,
                        int(cfg.conversations * per_history * cfg.device_fraction))
    options = dict(max_model_len=history_tokens + cfg.answer_tokens,
                   max_num_seqs=cfg.max_num_seqs, block_size=cfg.chat_block_size,
                   num_kv_blocks=device_blocks)
    engines = {"off": arcjax.LLM(cfg.model or None, **options),
               "on": arcjax.LLM(cfg.model or None, kv_offloading_size=cfg.host_gib, **options)}
    vocab = engines["on"].config.vocab_size
    params = arcjax.SamplingParams(max_tokens=cfg.answer_tokens, temperature=0,
                                   ignore_eos=True)

    def tokens(seed):
        rs = np.random.RandomState(seed)
        return [[rs.randint(3, vocab, cfg.turn_tokens).tolist()
                 for _ in range(cfg.conversations)] for _ in range(cfg.turns)]

    out = {"device_blocks": device_blocks, "history_blocks": per_history * cfg.conversations}
    answers = {}
    for mode, llm in engines.items():
        t0 = time.perf_counter()
        _replay(llm, tokens(cfg.seed + 1), params)  # warm-up: tokens never sent again
        warm_s = time.perf_counter() - t0
        before = llm.engine.stats()
        turns, answers[mode] = _replay(llm, tokens(cfg.seed), params)
        later = turns[1:]
        stats = llm.engine.stats()
        out[mode] = {"turns": turns, "warmup_s": warm_s,
                     "ttft_p50_later_turns_s": statistics.median(t["ttft_p50_s"] for t in later),
                     "prefill_tokens_later_turns": sum(t["prefill_tokens"] for t in later),
                     "wall_s": sum(t["wall_s"] for t in turns),
                     "host": {k: v if k in _SIZES else v - before[k]  # the replay's moves
                              for k, v in stats.items() if k.startswith("kv_")}}
    out["identical_outputs"] = answers["on"] == answers["off"]
    out["prefill_ratio_on_over_off"] = (out["on"]["prefill_tokens_later_turns"]
                                        / out["off"]["prefill_tokens_later_turns"])
    out["ttft_ratio_on_over_off"] = (out["on"]["ttft_p50_later_turns_s"]
                                     / out["off"]["ttft_p50_later_turns_s"])
    return out


def main(argv):
    del argv
    cfg = config_from_flags(KVBenchConfig)
    result = {"config": dataclasses.asdict(cfg), "hardware": {
        "platform": platform.platform(), "cpu_count": os.cpu_count()}}
    a = result["hybrid_vs_single"] = hybrid_vs_single(cfg)
    print(f"(a) {cfg.layers} layers (every {cfg.global_every}th global, window {cfg.window}): "
          f"{len(a['layout']['groups'])} groups of {a['layout']['num_slots']} layers; "
          f"{cfg.requests} requests x {cfg.tokens} tokens")
    for name in ("one_table", "hybrid"):
        m = a[name]
        print(f"  {name:9}: peak {m['peak_blocks']} blocks = {m['peak_layer_pages']} layer-pages"
              f" ({m['steps']} steps, planned in {m['wall_s']:.1f} s)")
    print(f"  peak hybrid / one table: {a['peak_ratio_hybrid_over_one_table']:.3f}")
    c = a["capacity"]
    for name in ("one_table", "hybrid"):
        print(f"  budget {c['budget_layer_pages']} layer-pages, {name:9}: "
              f"{c[name]['running']} of {cfg.capacity_requests} requests at once "
              f"(until {c[name]['stopped_by']}, {c[name]['steps']} steps)")
    if cfg.chat:
        b = result["chat_replay"] = chat_replay(cfg)
        print(f"(b) {cfg.conversations} conversations x {cfg.turns} turns of "
              f"{cfg.turn_tokens} + {cfg.answer_tokens} tokens; device cache "
              f"{b['device_blocks']} blocks of the histories' {b['history_blocks']}")
        for mode in ("off", "on"):
            m = b[mode]
            print(f"  host tier {mode:3}: TTFT p50 (turns 2+) {m['ttft_p50_later_turns_s']:.3f} s,"
                  f" prefill tokens (turns 2+) {m['prefill_tokens_later_turns']}, "
                  f"{m['wall_s']:.1f} s in all")
        print(f"  on / off: prefill tokens {b['prefill_ratio_on_over_off']:.3f}, TTFT p50 "
              f"{b['ttft_ratio_on_over_off']:.3f}; identical outputs: {b['identical_outputs']}")
        print(f"  host tier: {b['on']['host']}")
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    define_flags(KVBenchConfig)
    app.run(main)
