"""The burst experiment of docs/motivation.md, every arm side by side: K users arrive at once, each
with a P-word prompt; how long until each sees a first token, and does decoding stall?

  1. Build K deterministic P-word prompts (words from the tokenizer's vocabulary, --seed).
  2. Real run (default): one `LLM` whose buckets cover every arm, warmed before any window opens
     (--warmup=planned compiles the buckets the planner, run alone, says the arms will select;
     --warmup=all every bucket); each arm then runs the burst on a fresh engine over the same
     runner, inside a window that starts at the burst. A compile inside a run is an error.
  3. Each arm's steps are replayed through the simulator to get each step's kv_read and to check
     the planner is deterministic (--trace_out writes these calibration rows as JSONL).
  4. --calibrate_from=rows.jsonl (alone): fit the cost model, print its error, --save_cost_model.
     --compare: simulate the same arms with a cost model (--cost_model, --calibrate_from, or fitted
     to this very run) and print TTFT p50/p90 predicted / measured.
  5. --simulate: no engine at all; the arms run in `scheduler.simulate` with the cost model
     (--prompt_tokens=N replaces tokenizing with N-token prompts, e.g. the H200 replay).
  6. Tables on stdout, --out JSON, --plot PNG (TTFT CDF and step timeline per arm). Exits non-zero
     if an arm configures a knob that never engaged.

  python scripts/bench_burst.py --num_users=32 --out=runs/burst32.json --plot=runs/burst32.png \
      --trace_out=runs/trace32.jsonl --compare
  python scripts/bench_burst.py --calibrate_from=runs/trace32.jsonl --save_cost_model=fit.json
  python scripts/bench_burst.py --simulate --cost_model=fit.json --num_users=128
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arcjax.bench import burst, costmodel  # noqa: E402
import scheduler  # noqa: E402
from scheduler import SchedulerConfig, blocks_for  # noqa: E402
from scheduler.simulate import CostModel  # noqa: E402

DEFAULT_ARMS = ["prefill_first", "prefill_first:cap=4", "alternate:budget=2048",
                "token_budget:budget=512", "token_budget:budget=2048"]

_MODEL = flags.DEFINE_string("model", None, "HF model dir (default: the packaged model)")
_USERS = flags.DEFINE_integer("num_users", 32, "K: users arriving at once")
_WORDS = flags.DEFINE_integer("prompt_words", 256, "P: words per prompt")
_PROMPT_TOKENS = flags.DEFINE_integer(
    "prompt_tokens", 0, "--simulate only: prompts of exactly this many tokens instead of "
    "tokenizing P words (no model needed)")
_NEW = flags.DEFINE_integer("max_new_tokens", 32, "tokens each user generates (greedy, no EOS)")
_WINDOW = flags.DEFINE_float("window_s", 120.0, "measurement window from the burst (s)")
_ARMS = flags.DEFINE_list("arms", DEFAULT_ARMS,
                          "arms run one after another: policy[:key=value...], keys " +
                          ",".join(scheduler.ARM_KEYS))
_BUDGET = flags.DEFINE_integer(
    "max_num_batched_tokens", 4096, "token budget of arms that set none (4096: ~10 whole 400-token "
    "prompts per prefill step, the legacy server's step in docs/motivation.md's K=32 run)")
_REPEATS = flags.DEFINE_integer("repeats", 1, "real runs of every arm, round-robin; each arm's "
                                "table column is its run with the median TTFT p50")
_TILE = flags.DEFINE_integer("chunk_tile", 128, "non-final chunks are multiples of it")
_BLOCK = flags.DEFINE_integer("block_size", 16, "tokens per KV block")
_BLOCKS = flags.DEFINE_integer("num_kv_blocks", 0, "KV blocks; 0 = room for the whole burst")
_SEED = flags.DEFINE_integer("seed", 0, "prompt seed")
_ATTN = flags.DEFINE_string("attention_impl", "auto", "attention implementation")
_OUT = flags.DEFINE_string("out", None, "write every result as JSON here")
_PLOT = flags.DEFINE_string("plot", None, "write the TTFT CDF and step timelines (PNG) here")
_TRACE_OUT = flags.DEFINE_string("trace_out", None,
                                 "write calibration rows (every real step, JSONL) here")
_SIMULATE = flags.DEFINE_bool("simulate", False, "run the arms in the simulator only")
_COMPARE = flags.DEFINE_bool("compare", False, "after the real run, simulate the same arms and "
                             "print predicted / measured TTFT")
_CALIBRATE = flags.DEFINE_list("calibrate_from", [], "fit the cost model to these JSONL files "
                               "(--trace_out rows, or an engine trace)")
_COST = flags.DEFINE_string("cost_model", None, "cost model JSON (CostModel.to_json()), or "
                            "h200_legacy (docs/motivation.md's server, see arcjax/costmodel.py)")
_SAVE_COST = flags.DEFINE_string("save_cost_model", None, "write the fitted cost model here")
_WARMUP = flags.DEFINE_enum(
    "warmup", "planned", ["planned", "all"], "compile before any window: the buckets the "
    "planner (run alone, deterministic) says the arms will use, or every bucket (LLM.warmup)")
_CACHE = flags.DEFINE_string("compilation_cache_dir", None,
                             "persistent JAX compilation cache (warm-up is faster the 2nd time)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BurstConfig:
    model: str | None
    num_users: int
    prompt_words: int
    prompt_tokens: int
    max_new_tokens: int
    window_s: float
    arms: tuple[scheduler.Arm, ...]
    max_num_batched_tokens: int
    repeats: int
    chunk_tile: int
    block_size: int
    num_kv_blocks: int
    seed: int
    attention_impl: str
    out: str | None
    plot: str | None
    trace_out: str | None
    simulate: bool
    compare: bool
    calibrate_from: tuple[str, ...]
    cost_model: str | None
    save_cost_model: str | None
    warmup: str
    compilation_cache_dir: str | None

    @classmethod
    def from_flags(cls) -> "BurstConfig":
        return cls(model=_MODEL.value, num_users=_USERS.value, prompt_words=_WORDS.value,
                   prompt_tokens=_PROMPT_TOKENS.value, max_new_tokens=_NEW.value,
                   window_s=_WINDOW.value, arms=tuple(scheduler.parse_arm(a) for a in _ARMS.value),
                   max_num_batched_tokens=_BUDGET.value, repeats=_REPEATS.value,
                   chunk_tile=_TILE.value,
                   block_size=_BLOCK.value, num_kv_blocks=_BLOCKS.value, seed=_SEED.value,
                   attention_impl=_ATTN.value, out=_OUT.value, plot=_PLOT.value,
                   trace_out=_TRACE_OUT.value, simulate=_SIMULATE.value,
                   compare=_COMPARE.value, calibrate_from=tuple(_CALIBRATE.value),
                   cost_model=_COST.value, save_cost_model=_SAVE_COST.value,
                   warmup=_WARMUP.value, compilation_cache_dir=_CACHE.value)


# --- workload ----------------------------------------------------------------------------------

def model_dir(cfg: BurstConfig) -> str:
    import arcjax

    return cfg.model or str(arcjax.default_model_path())


def make_prompts(cfg: BurstConfig) -> tuple[list[list[int]], dict]:
    """Token ids of the K prompts, and how they were made."""
    if cfg.simulate and cfg.prompt_tokens:
        ids = [[1 + (u * 7919 + j) % 30000 for j in range(cfg.prompt_tokens)]
               for u in range(cfg.num_users)]
        return ids, {"prompt_tokens": cfg.prompt_tokens}
    from arcjax.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir(cfg))
    pool = burst.word_pool(tok)
    texts = burst.burst_prompts(pool, cfg.num_users, cfg.prompt_words, cfg.seed)
    ids = [tok.encode(t) for t in texts]
    lens = [len(i) for i in ids]
    return ids, {"prompt_words": cfg.prompt_words, "word_pool": len(pool),
                 "prompt_tokens_mean": sum(lens) / len(lens), "prompt_tokens_min": min(lens),
                 "prompt_tokens_max": max(lens), "example": texts[0][:120]}


def num_blocks(cfg: BurstConfig, prompts) -> int:
    if cfg.num_kv_blocks:
        return cfg.num_kv_blocks
    return sum(blocks_for(len(p) + cfg.max_new_tokens, cfg.block_size) for p in prompts) + 8


def base_config(cfg: BurstConfig, prompts) -> SchedulerConfig:
    """The config every arm derives from: default budget, all K users may run at once."""
    return SchedulerConfig(max_num_batched_tokens=cfg.max_num_batched_tokens,
                           max_num_seqs=cfg.num_users, chunk_tile=cfg.chunk_tile,
                           block_size=cfg.block_size, num_blocks=num_blocks(cfg, prompts))


# --- real run ----------------------------------------------------------------------------------

def real_run(cfg: BurstConfig, prompts, base: SchedulerConfig) -> tuple[list, list[dict], dict]:
    """Every arm on one warmed engine, `repeats` times round-robin.

    Returns (each arm's runs, calibration rows, engine facts).
    """
    import arcjax
    from arcjax.runtime.runner import enable_persistent_compilation_cache

    if cfg.compilation_cache_dir:
        enable_persistent_compilation_cache(cfg.compilation_cache_dir)
    arm_configs = [a.config(base) for a in cfg.arms]
    longest = max(len(p) for p in prompts)
    max_len = -(-(longest + cfg.max_new_tokens) // cfg.block_size) * cfg.block_size
    t = time.perf_counter()
    llm = arcjax.LLM(model_dir(cfg), max_model_len=max_len, num_kv_blocks=base.num_blocks,
                     block_size=cfg.block_size, attention_impl=cfg.attention_impl,
                     policy="token_budget", chunk_tile=min(c.chunk_tile for c in arm_configs),
                     max_num_batched_tokens=max(c.max_num_batched_tokens for c in arm_configs),
                     max_num_seqs=max(c.max_num_seqs for c in arm_configs))
    runner = llm.engine.runner
    top_tokens, top_seqs = runner.buckets.token_rungs[-1], runner.buckets.seq_rungs[-1]
    for arm, c in zip(cfg.arms, arm_configs):
        if max(c.max_num_batched_tokens, longest) > top_tokens or c.max_num_seqs > top_seqs:
            raise SystemExit(f"arm {arm.name}: buckets ({top_tokens} tokens, {top_seqs} seqs) "
                             "do not cover it")
    load_s = time.perf_counter() - t
    requests = costmodel.burst_requests(prompts, cfg.max_new_tokens)
    rehearsal = costmodel.burst_requests(prompts[:2], 2)
    if cfg.warmup == "all":
        warm_s = llm.warmup()
    else:
        needed = set(burst.planned_buckets(runner.buckets, arm_configs[0], rehearsal))
        for c in arm_configs:
            needed |= burst.planned_buckets(runner.buckets, c, requests)
        warm_s = runner.warm(needed)
    # Rehearsal (not measured): a few users through the first arm warm the host-side paths.
    burst.run_arm(llm.engine, cfg.arms[0], base, prompts[:2], 2, cfg.window_s)
    print(f"model {llm.model_dir}: loaded in {load_s:.1f} s; warm-up ({cfg.warmup}) compiled "
          f"{runner.num_executables} of {len(runner.buckets.all())} buckets in {warm_s:.1f} s")
    facts = {"model_dir": str(llm.model_dir), "model_config": dataclasses.asdict(llm.config),
             "dtype": str(runner.dtype), "attention_impl": runner.attn_impl,
             "buckets": {"token_rungs": runner.buckets.token_rungs,
                         "seq_rungs": runner.buckets.seq_rungs,
                         "count": len(runner.buckets.all())},
             "warmup_s": warm_s, "compiles_after_warmup": 0, "max_model_len": max_len,
             "num_kv_blocks": base.num_blocks}
    per_arm: list[list] = [[] for _ in cfg.arms]
    rows = []
    for rep in range(cfg.repeats):
        for i, (arm, c) in enumerate(zip(cfg.arms, arm_configs)):
            before = runner.num_executables
            run, _ = burst.run_arm(llm.engine, arm, base, prompts, cfg.max_new_tokens,
                                   cfg.window_s)
            facts["compiles_after_warmup"] += runner.num_executables - before
            per_arm[i].append(run)
            rows += [dict(r, repeat=rep) for r in
                     costmodel.replay_rows(c, requests, run.steps, arm.name)]
            print(f"  {arm.name} (run {rep + 1}/{cfg.repeats}): {len(run.steps)} steps, "
                  f"{run.steps[-1].end - run.t0:.1f} s")
    return per_arm, rows, facts


# --- cost model --------------------------------------------------------------------------------

def get_cost_model(cfg: BurstConfig, rows: list[dict] | None,
                   save: bool = True) -> tuple[CostModel, dict]:
    """--cost_model, else a fit to --calibrate_from, else a fit to `rows`, else the default.
    A fitted model is written to --save_cost_model if `save`."""
    if cfg.cost_model:
        return costmodel.load_cost_model(cfg.cost_model), {"source": cfg.cost_model}
    if cfg.calibrate_from:
        rows = [r for path in cfg.calibrate_from for r in costmodel.read_rows(path)]
        source = ",".join(cfg.calibrate_from)
    elif rows:
        source = "this run"
    else:
        return CostModel(), {"source": "scheduler.simulate.CostModel defaults"}
    model, report = costmodel.fit_cost_model(rows)
    print(f"cost model fitted to {source}: " + ", ".join(
        f"{k} = {v:.4g}" for k, v in model.to_json().items()))
    print("  " + report.describe())
    if "kv_read" not in report.features:
        print("  (no kv_read in the rows: c_kv fixed at 0)")
    if cfg.save_cost_model and save:
        costmodel.save_cost_model(model, cfg.save_cost_model)
    return model, {"source": source, "fit": report.to_json()}


# --- plot --------------------------------------------------------------------------------------

def plot(results: list[dict], runs: list, path: str, title: str) -> None:
    """TTFT CDF of every arm, then each arm's step timeline (prefill and decode tokens stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    fig, axes = plt.subplots(1 + n, 1, figsize=(11, 3.2 + 1.9 * n),
                             gridspec_kw={"height_ratios": [2.2] + [1] * n})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ax = axes[0]
    for i, (m, run) in enumerate(zip(results, runs)):
        xs = sorted(m["ttft_s"])
        k = m["num_users"]
        ax.step([0] + xs, [0] + [(j + 1) / k for j in range(len(xs))], where="post",
                color=colors[i % len(colors)], lw=2,
                label=f"{m['arm']} (p50 " + ("-" if m["ttft_p50_s"] is None else
                                             f"{m['ttft_p50_s']:.3g} s") + ")")
    ax.set_xlabel("time to first token (s, from the burst)")
    ax.set_ylabel("fraction of users")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(title, fontsize=10)
    xmax = max((run.window[1] - run.t0 for run in runs), default=1.0)
    ymax = max((s.prefill_tokens + s.decode_tokens for run in runs for s in run.steps), default=1)
    users = max((len(run.requests) for run in runs), default=1)
    for i, (ax, run) in enumerate(zip(axes[1:], runs)):
        starts = [s.start - run.t0 for s in run.steps]
        widths = [max(s.end - s.start, 1e-3) for s in run.steps]
        pre = [s.prefill_tokens for s in run.steps]
        dec = [s.decode_tokens for s in run.steps]
        edges = {"edgecolor": "white", "linewidth": 0.4 if len(run.steps) < 150 else 0}
        ax.bar(starts, pre, width=widths, align="edge", color="tab:orange", alpha=0.85,
               label="prefill tokens", **edges)
        ax.bar(starts, dec, width=widths, bottom=pre, align="edge", color="tab:blue",
               label="decode tokens (stacked)", **edges)
        ax.set_xlim(0, xmax)
        ax.set_ylim(0, ymax * 1.08)
        ax.set_ylabel("tokens / step", fontsize=8)
        ax.set_title(run.arm, loc="left", fontsize=9, color=colors[i % len(colors)],
                     fontweight="bold", pad=3)
        ax.grid(alpha=0.3)
        # Decode rows are few next to prefill tokens: repeat them on their own scale.
        rows = ax.twinx()
        xs = [x for a, w in zip(starts, widths) for x in (a, a + w)]
        rows.plot(xs, [d for d in dec for _ in (0, 1)], color="navy", lw=1.2,
                  label="decode rows (right axis)")
        rows.set_ylim(0, users * 1.08)
        rows.set_ylabel("decode rows", fontsize=8, color="navy")
        rows.tick_params(axis="y", labelsize=7, colors="navy")
        ax.tick_params(axis="both", labelsize=7)
        if i == 0:
            handles = ax.get_legend_handles_labels()
            extra = rows.get_legend_handles_labels()
            ax.legend(handles[0] + extra[0], handles[1] + extra[1], loc="upper right", fontsize=7,
                      framealpha=0.9)
    axes[-1].set_xlabel("time since the burst (s); bar width = step duration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main --------------------------------------------------------------------------------------

def _jsonable(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def hardware() -> dict:
    import jax

    return {"platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "jax_backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()]}


def main(argv):
    del argv
    cfg = BurstConfig.from_flags()
    if cfg.calibrate_from and not (cfg.simulate or cfg.compare):  # fit and save only
        get_cost_model(cfg, None)
        return
    prompts, workload = make_prompts(cfg)
    base = base_config(cfg, prompts)
    requests = costmodel.burst_requests(prompts, cfg.max_new_tokens)
    print(f"burst: {cfg.num_users} users, {workload}, {cfg.max_new_tokens} new tokens each, "
          f"window {cfg.window_s:.0f} s, {base.num_blocks} KV blocks of {base.block_size}")
    out = {"config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "arms"},
           "arms": [a.name for a in cfg.arms], "workload": workload,
           "base_scheduler_config": dataclasses.asdict(base)}
    runs, real, simulated, rows = [], None, None, None
    if cfg.simulate:
        cost, out["cost_model"] = get_cost_model(cfg, None)
        out["cost_model"]["coefficients"] = cost.to_json()
        runs = [costmodel.simulate_arm(a, base, requests, cost, cfg.window_s) for a in cfg.arms]
        simulated = [burst.burst_metrics(r) for r in runs]
        print(f"\nsimulated ({out['cost_model']['source']}):")
        print(burst.format_table(simulated))
        out["simulated"] = simulated
    else:
        out["hardware"] = hardware()
        per_arm, rows, out["engine"] = real_run(cfg, prompts, base)
        runs, real = [], []
        for arm_runs in per_arm:
            run, m = burst.median_run(arm_runs)
            runs.append(run)
            real.append(m)
        print(f"\nmeasured ({out['hardware']['processor']}, {out['hardware']['cpu_count']} cores, "
              f"{out['hardware']['jax_backend']}):")
        print(burst.format_table(real))
        out["real"] = real
        if cfg.trace_out:
            costmodel.write_rows(rows, cfg.trace_out)
        if cfg.compare:
            # The given model (if any) predicts out of sample; a fit to this run, in sample.
            models = []
            if cfg.cost_model or cfg.calibrate_from:
                models.append(get_cost_model(cfg, None, save=False))
            models.append(get_cost_model(
                dataclasses.replace(cfg, cost_model=None, calibrate_from=()), rows))
            out["comparisons"] = []
            for cost, info in models:
                sim = [burst.burst_metrics(costmodel.simulate_arm(a, base, requests, cost,
                                                                  cfg.window_s))
                       for a in cfg.arms]
                ratios = burst.ratio_rows(real, sim)
                print(f"\nsimulation ({info['source']}) vs measurement, TTFT:")
                print(burst.format_ratios(ratios))
                out["comparisons"].append({"cost_model": dict(info, coefficients=cost.to_json()),
                                           "simulated": sim, "sim_over_real": ratios})
    results = real if real is not None else simulated
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(_jsonable(out), f, indent=1)
    if cfg.plot:
        what = "measured" if real is not None else "simulated"
        prompt = (f"{cfg.prompt_tokens}-token" if cfg.simulate and cfg.prompt_tokens
                  else f"{cfg.prompt_words}-word")
        plot(results, runs, cfg.plot,
             f"{what}: K={cfg.num_users} users at once, {prompt} prompts, "
             f"{cfg.max_new_tokens} new tokens each, window {cfg.window_s:.0f} s")
    failures = [f"{m['arm']}: configured {k} never engaged" for m in results
                for k in m["knobs_never_engaged"]]
    failures += [f"{m['arm']}: {m['compiles_in_run']} compiles inside the run"
                 for m in results if m["compiles_in_run"]]
    if failures:
        raise SystemExit("FAILED: " + "; ".join(failures))


if __name__ == "__main__":
    app.run(main)
