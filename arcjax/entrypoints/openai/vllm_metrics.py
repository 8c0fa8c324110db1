"""vLLM's Prometheus metric names (`vllm:*`), beside the server's `arcjax_*` ones, so vLLM
dashboards and autoscalers read an arcjax server unchanged.

Labels as vLLM's: `model_name` and `engine` ("0": one engine). Fed from the same places
as `server_metrics.ServerMetrics`: every engine step (`on_step`: iteration tokens,
preemptions, speculative decoding), every finished request (`on_finished`: latencies,
token counts, finish reasons, prefix-cache queries and hits, the request's n and
max_tokens), and the engine's state at scrape time (running, waiting, KV-cache usage,
the cache config's info gauge).

NOTE: vLLM counts prompt tokens and prefix-cache queries when a step computes them; this
server counts them when the request finishes (the totals agree once requests finish).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from arcjax.outputs import PoolingRequestOutput, RequestOutput
from arcjax.sampling_params import SamplingParams
from scheduler.metrics import StepRecord

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort", "error")


def _one_two_five(limit: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class _Gauges:
    """vLLM's gauges, read from `engine.stats()` once per scrape."""

    def __init__(self, engine, labels: dict):
        self._engine, self._labels = engine, labels

    def collect(self):
        s = self._engine.stats()
        usage = s["kv_blocks_in_use"] / max(s["kv_blocks_total"], 1)
        for name, value, doc in (
                ("vllm:num_requests_running", s["running"], "Requests in model execution."),
                ("vllm:num_requests_waiting", s["waiting"], "Requests waiting to be processed."),
                ("vllm:kv_cache_usage_perc", usage, "KV-cache usage. 1 means 100 percent."),
                ("vllm:gpu_cache_usage_perc", usage, "KV-cache usage (vLLM's old name).")):
            family = GaugeMetricFamily(name, doc, labels=list(self._labels))
            family.add_metric(list(self._labels.values()), value)
            yield family
        cfg = self._engine.sched_config
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration.",
                                 labels=["block_size", "num_gpu_blocks",
                                         "enable_prefix_caching", "engine"])
        info.add_metric([str(cfg.block_size), str(cfg.num_blocks),
                         str(cfg.enable_prefix_caching), "0"], 1)
        yield info


class VllmMetrics:
    """vLLM's metrics of one server, in the server's registry (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, engine, model_name: str):
        labels = {"model_name": model_name, "engine": "0"}
        r, names = registry, list(labels)

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*names, *extra], registry=r)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**labels)

        limit = engine.max_model_len
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", _TPOT)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Time per output token (each gap).", _TPOT)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Mean time per output token of a request.", _TPOT)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end latency.",
                             _REQUEST)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time spent waiting.",
                               _REQUEST)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "First scheduled to finished.", _REQUEST)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "First scheduled to first token.", _REQUEST)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "First token to finished.", _REQUEST)
        self.prompt_hist = histogram("vllm:request_prompt_tokens", "Prompt tokens.",
                                     _one_two_five(limit))
        self.generation_hist = histogram("vllm:request_generation_tokens",
                                         "Generated tokens.", _one_two_five(limit))
        self.params_n = histogram("vllm:request_params_n", "The n request parameter.",
                                  (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "The max_tokens request parameter.",
                                           _one_two_five(limit))
        self.iteration = histogram("vllm:iteration_tokens_total", "Tokens per engine step.",
                                   _ITERATION)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens.").labels(**labels)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Generated tokens.").labels(**labels)
        self.preemptions = counter("vllm:num_preemptions", "Preemptions.").labels(**labels)
        self.cache_queries = counter("vllm:prefix_cache_queries",
                                     "Prefix-cache queries (tokens).").labels(**labels)
        self.cache_hits = counter("vllm:prefix_cache_hits",
                                  "Prefix-cache hits (tokens).").labels(**labels)
        success = counter("vllm:request_success", "Finished requests.", ["finished_reason"])
        self.success = {f: success.labels(finished_reason=f, **labels) for f in FINISHED_REASONS}
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Drafts.").labels(**labels)
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                         "Draft tokens.").labels(**labels)
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                     "Accepted draft tokens.").labels(**labels)
        self._spec_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens by position.", ["position"])
        self._labels = labels
        r.register(_Gauges(engine, labels))

    def on_step(self, record: StepRecord) -> None:
        """A step's iteration tokens, preemptions and drafts (engine thread)."""
        self.iteration.observe(record.prefill_tokens + record.decode_tokens)
        preempted = record.engaged.get("preempted") or ()
        if preempted:
            self.preemptions.inc(len(preempted))
        if record.spec_drafts:
            self.spec_drafts.inc(record.spec_drafts)
            self.spec_draft_tokens.inc(record.spec_draft_tokens)
            self.spec_accepted.inc(record.spec_accepted_tokens)
            for position, n in enumerate(record.spec_accepted_per_pos):
                self._spec_per_pos.labels(position=str(position), **self._labels).inc(n)

    def on_pooled(self, out: PoolingRequestOutput) -> None:
        """One finished embedding request (event loop): its prompt tokens and reason."""
        prompt = len(out.prompt_token_ids)
        self.prompt_tokens.inc(prompt)
        self.prompt_hist.observe(prompt)
        child = self.success.get(out.finish_reason)
        if child is not None:
            child.inc()

    def on_finished(self, out: RequestOutput, params: SamplingParams | None) -> None:
        """One finished request (event loop)."""
        m = out.metrics
        prompt, generated = len(out.prompt_token_ids), len(m.token_times)
        for hist, value in ((self.ttft, m.ttft), (self.e2e, m.e2e_latency),
                            (self.queue, m.queue_time), (self.request_tpot, m.tpot)):
            if value is not None:
                hist.observe(value)
        for gap in m.itl:
            self.itl.observe(gap)
            self.tpot.observe(gap)
        if m.first_scheduled_time is not None and m.finished_time is not None:
            self.inference.observe(m.finished_time - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.prefill.observe(m.first_token_time - m.first_scheduled_time)
                self.decode.observe(m.finished_time - m.first_token_time)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.prompt_hist.observe(prompt)
        self.generation_hist.observe(generated)
        self.cache_queries.inc(prompt)
        self.cache_hits.inc(out.num_cached_tokens)
        if params is not None:
            self.params_n.observe(params.n)
            self.params_max_tokens.observe(params.max_tokens)
        child = self.success.get(out.finish_reason)
        if child is not None:
            child.inc()
