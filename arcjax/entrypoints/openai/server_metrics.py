"""Prometheus metrics of one server: its own registry, fed by the engine and by finished requests.

- Per step (engine thread, `Engine.trace_sink`): steps, preemptions, and for every scheduling
  knob the steps in which it engaged (the trace's engagement log as counters; the same
  counting as `arcjax.engine.trace.engagement`); speculative decoding's drafts, draft and
  accepted tokens, accepted tokens per draft position (vLLM's `spec_decode_*` counters;
  acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts).
- Per finished request (event loop): TTFT, inter-token latency and end-to-end latency
  histograms; prompt, generated and prefix-cache-hit token counters; requests by finish reason.
- At scrape time: gauges from `Engine.stats()` (running, waiting, KV blocks in use / total),
  and with a host tier (`kv_offloading_size`) its slots and counters: blocks loaded back
  (host hits) and stored, bytes moved each way, and the loads' latency (sum and count);
  with LoRA its device slots, slot swaps, adapters read from disk and loaded on the host.
- Per adapter (event loop): finished requests by the LoRA adapter they ran with
  (`arcjax_lora_requests_total{lora_name}`).

vLLM's names (`vllm:*`) are exported beside these from the same events
(`vllm_metrics.VllmMetrics`).

NOTE: the registry belongs to the server object (no process-global state), so tests can run
several servers in one process. prometheus_client metrics are thread-safe.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from arcjax.entrypoints.openai.vllm_metrics import VllmMetrics
from arcjax.outputs import PoolingRequestOutput, RequestOutput
from arcjax.pooling_params import PoolingParams
from arcjax.sampling_params import SamplingParams
from scheduler.metrics import StepRecord
from scheduler.step_plan import Engaged

# Scheduler `Engaged` fields (scheduler/step_plan.py) counted per step.
KNOBS = tuple(f.name for f in dataclasses.fields(Engaged))

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
            0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
FINISH_REASONS = ("length", "stop", "abort", "error")
# The host tier's counters (`EngineCore.stats`), exposed as `<name>_total`.
HOST_TIER_COUNTERS = (
    ("arcjax_kv_host_hit_blocks", "kv_host_hit_blocks",
     "KV blocks a prefix hit loaded back from the host tier."),
    ("arcjax_kv_host_stored_blocks", "kv_host_stored_blocks",
     "KV blocks the device evicted and stored in the host tier."),
    ("arcjax_kv_bytes_to_host", "kv_bytes_to_host", "KV bytes copied to the host tier."),
    ("arcjax_kv_bytes_to_device", "kv_bytes_to_device", "KV bytes loaded back to the device."),
    ("arcjax_kv_load_seconds", "kv_load_seconds_sum",
     "Seconds from dispatch until a host-tier load landed, summed."),
    ("arcjax_kv_loads_timed", "kv_loads_timed", "Host-tier loads timed."),
)

# LoRA's counters (`EngineCore.stats`), exposed as `<name>_total`.
LORA_COUNTERS = (
    ("arcjax_lora_slot_swaps", "lora_slot_swaps", "LoRA adapters written into a device slot."),
    ("arcjax_lora_adapter_loads", "lora_adapter_loads",
     "LoRA adapters read from disk (or the Hub) into host memory."),
)


class _EngineGauges:
    """Gauges read from `engine.stats()` once per scrape."""

    def __init__(self, engine):
        self._engine = engine

    def collect(self):
        s = self._engine.stats()
        for name, key, doc in (
                ("arcjax_num_requests_running", "running", "Requests running in the engine."),
                ("arcjax_num_requests_waiting", "waiting", "Requests waiting to be scheduled."),
                ("arcjax_kv_blocks_in_use", "kv_blocks_in_use", "KV cache blocks in use."),
                ("arcjax_kv_blocks_total", "kv_blocks_total", "KV cache blocks in all.")):
            yield GaugeMetricFamily(name, doc, value=s[key])
        yield from self._lora(s)
        if "kv_host_blocks_total" not in s:  # no host tier
            return
        yield GaugeMetricFamily("arcjax_kv_host_blocks_total", "Host-tier KV block slots.",
                                value=s["kv_host_blocks_total"])
        for name, key, doc in HOST_TIER_COUNTERS:
            yield CounterMetricFamily(name, doc, value=s[key])

    def _lora(self, s: dict):
        if "lora_slots_total" not in s:  # LoRA is off
            return
        yield GaugeMetricFamily("arcjax_lora_slots_total", "Device slots for LoRA adapters "
                                "(max_loras).", value=s["lora_slots_total"])
        yield GaugeMetricFamily("arcjax_lora_adapters_loaded", "LoRA adapters loaded in "
                                "host memory.", value=s["lora_adapters_loaded"])
        for name, key, doc in LORA_COUNTERS:
            yield CounterMetricFamily(name, doc, value=s[key])


class ServerMetrics:
    """The metrics of one server (see the module docstring)."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, ["model_name", *extra], registry=r)

        self.ttft = Histogram("arcjax_time_to_first_token_seconds", "Time to first token.",
                              ["model_name"], buckets=_LATENCY, registry=r).labels(**labels)
        self.itl = Histogram("arcjax_inter_token_latency_seconds",
                             "Gap between consecutive output tokens.", ["model_name"],
                             buckets=_LATENCY, registry=r).labels(**labels)
        self.e2e = Histogram("arcjax_e2e_request_latency_seconds",
                             "Arrival to last token.", ["model_name"], buckets=_E2E,
                             registry=r).labels(**labels)
        self.prompt_tokens = counter("arcjax_prompt_tokens", "Prompt tokens of finished "
                                     "requests.").labels(**labels)
        self.generation_tokens = counter("arcjax_generation_tokens",
                                         "Tokens generated.").labels(**labels)
        self.cached_tokens = counter("arcjax_prefix_cache_hit_tokens", "Prompt tokens served "
                                     "from the prefix cache.").labels(**labels)
        requests = counter("arcjax_requests", "Finished requests by finish reason.",
                           ["finish_reason"])
        self.requests = {f: requests.labels(finish_reason=f, **labels) for f in FINISH_REASONS}
        self.steps = counter("arcjax_engine_steps", "Engine steps.").labels(**labels)
        self.preemptions = counter("arcjax_preemptions", "Sequences preempted for KV "
                                   "blocks.").labels(**labels)
        knob = counter("arcjax_scheduler_knob_engaged_steps", "Steps in which a scheduling "
                       "knob engaged (scheduler Engaged fields).", ["knob"])
        self.knobs = {k: knob.labels(knob=k, **labels) for k in KNOBS}
        self.spec_drafts = counter("arcjax_spec_decode_num_drafts", "Decode rows that "
                                   "verified draft tokens.").labels(**labels)
        self.spec_draft_tokens = counter("arcjax_spec_decode_num_draft_tokens",
                                         "Draft tokens verified.").labels(**labels)
        self.spec_accepted_tokens = counter("arcjax_spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.").labels(**labels)
        self._spec_per_pos = counter("arcjax_spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     ["position"])
        self._lora_requests = counter("arcjax_lora_requests", "Finished requests by the LoRA "
                                      "adapter they ran with.", ["lora_name"])
        self._knob_family = knob
        self._labels = labels
        r.register(_EngineGauges(engine))
        self.vllm = VllmMetrics(r, engine, model_name)

    # --- engine thread ----------------------------------------------------------------
    def on_step(self, record: StepRecord) -> None:
        """`Engine.trace_sink`: counts the step, its preemptions and engaged knobs."""
        self.steps.inc()
        self.vllm.on_step(record)
        if record.spec_drafts:
            self.spec_drafts.inc(record.spec_drafts)
            self.spec_draft_tokens.inc(record.spec_draft_tokens)
            self.spec_accepted_tokens.inc(record.spec_accepted_tokens)
            for position, n in enumerate(record.spec_accepted_per_pos):
                self._spec_per_pos.labels(position=str(position), **self._labels).inc(n)
        engaged = record.engaged
        preempted = engaged.get("preempted") or ()
        if preempted:
            self.preemptions.inc(len(preempted))
        for name, value in engaged.items():
            if value:
                child = self.knobs.get(name)
                if child is None:  # a knob added to the scheduler after this module
                    child = self.knobs[name] = self._knob_family.labels(knob=name,
                                                                         **self._labels)
                child.inc()

    # --- event loop -------------------------------------------------------------------
    def on_finished(self, out: RequestOutput | PoolingRequestOutput,
                    params: SamplingParams | PoolingParams | None = None,
                    lora_name: str | None = None) -> None:
        """Records one finished request (`params`: its parameters, when known; `lora_name`:
        the LoRA adapter it ran with, None: the base model); an embedding counts its
        prompt tokens and its finish reason."""
        if isinstance(out, PoolingRequestOutput):
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.vllm.on_pooled(out)
            child = self.requests.get(out.finish_reason)
            if child is not None:
                child.inc()
            return
        self.vllm.on_finished(out, params)
        if lora_name is not None:
            self._lora_requests.labels(lora_name=lora_name, **self._labels).inc()
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.itl:
            self.itl.observe(gap)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(m.token_times))  # whatever the output's kind
        if out.num_cached_tokens:
            self.cached_tokens.inc(out.num_cached_tokens)
        child = self.requests.get(out.finish_reason)
        if child is not None:
            child.inc()

    def on_aborted(self) -> None:
        """A request the server aborted (its client left) before its final output."""
        self.requests["abort"].inc()
        self.vllm.success["abort"].inc()
