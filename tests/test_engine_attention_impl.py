"""Which attention implementation the engine runs, and says it runs.

"auto" is resolved once per bucket when the bucket's step is compiled (and the step is
compiled with what it resolved to), from the arguments the decoder passes: window,
soft-cap, FP8 page scales, the bucket's chunk bound, the platform. The trace summary and
/v1/models name the result per bucket kind. On this CPU machine everything is "xla" (an
engine's summary: tests/test_engine.py, test_trace_metrics_summary_and_jsonl); the GPU
cases here simulate the backend facts (`pallas_kernels.backends`) a GPU host reports.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from arcjax import LLM, EngineConfigError
from arcjax.engine.engine_config import ATTENTION_IMPLS, EngineConfig
from scheduler.metrics import StepRecord
from arcjax.engine.trace import attention_report
from arcjax.model import decoder
from arcjax.model.model_config import ModelConfig
from arcjax.runtime.buckets import BucketSet
from pallas_kernels import backends, cpu_build
from support.engines import GEOMETRY
from support.hf_models import tiny_model_dir


def _cfg(**changes) -> ModelConfig:
    base = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64)
    return dataclasses.replace(base, **changes)


def _cache(block_size=16, kv_dtype=jnp.bfloat16, scaled=False) -> dict:
    k = jax.ShapeDtypeStruct((2 * 32, block_size, 2, 64), kv_dtype)  # [L * blocks, bs, Hkv, D]
    cache = {"k": k, "v": k}
    if scaled:
        cache |= {"k_scale": jax.ShapeDtypeStruct((2,), jnp.float32),
                  "v_scale": jax.ShapeDtypeStruct((2,), jnp.float32)}
    return cache


def _gpu(monkeypatch, *, pallas: str, triton: str | None, mosaic_verified: bool) -> None:
    """Simulates a GPU host's backend facts: Pallas-Triton's state, why jax_triton cannot
    launch (None: it can), whether the Mosaic GPU kernel has a passing GPU run here."""
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: pallas)
    monkeypatch.setattr(backends, "triton_unavailable", lambda: triton)
    monkeypatch.setattr(backends, "mosaic_gpu_unavailable", lambda: None)
    monkeypatch.setattr(backends, "device_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(backends.verified, "has_passed", lambda impl, kind, shape=None, path=None:
                        mosaic_verified and impl == "mosaic_gpu")


def _summary(cfg, cache, *, dtype=jnp.bfloat16, impl="auto", platform="gpu") -> dict:
    """What the trace summary would say after one step in every bucket of a small ladder,
    each bucket resolved as the runner resolves it."""
    buckets = BucketSet.create(tile=16, max_tokens=32, max_seqs=8).all()
    impls = {(b.tokens, b.seqs, b.max_q_len): decoder.attention_impl(
        cache, cfg=cfg, attn_impl=impl, tokens=b.tokens, max_q_len=b.max_q_len, dtype=dtype,
        platform=platform) for b in buckets}
    records = [StepRecord(start=0.0, end=1.0, prefill_tokens=0, decode_tokens=1, num_seqs=1,
                          engaged={}, bucket=key) for key in impls]
    report = attention_report(impl, impls, records)
    return {k: report[k] for k in ("decode", "prefill")}


WINDOWED = dict(sliding_window=8, sliding_layers=(True, False))


@pytest.mark.parametrize("pallas,triton,verified,plain,special", [
    # Pallas-Triton current: it serves every bucket (it has windows, caps and scales).
    ("current", None, False, ("pallas_gpu", "pallas_gpu"), ("pallas_gpu", "pallas_gpu")),
    # Deprecated (JAX 0.11): the jax-triton kernel; never the deprecated backend.
    ("deprecated", None, False, ("triton", "triton"), ("triton", "triton")),
    ("absent", None, False, ("triton", "triton"), ("triton", "triton")),
    # No jax_triton either: xla.
    ("deprecated", "jax_triton missing", False, ("xla", "xla"), ("xla", "xla")),
    # A passing GPU run of Mosaic GPU: plain decode buckets take it, prefill buckets and
    # windowed / soft-capped / FP8 models keep the Triton kernel.
    ("deprecated", None, True, ("mosaic_gpu", "triton"), ("triton", "triton")),
    ("current", None, True, ("mosaic_gpu", "pallas_gpu"), ("pallas_gpu", "pallas_gpu")),
], ids=["pallas", "pallas-deprecated", "pallas-absent", "no-jax-triton", "mosaic-verified",
        "mosaic-and-pallas"])
def test_auto_per_bucket_kind_on_a_simulated_gpu(monkeypatch, pallas, triton, verified,
                                                plain, special):
    _gpu(monkeypatch, pallas=pallas, triton=triton, mosaic_verified=verified)
    expect = lambda pair: {"decode": [pair[0]], "prefill": [pair[1]]}  # noqa: E731
    assert _summary(_cfg(), _cache()) == expect(plain)
    for cfg, cache in [(_cfg(**WINDOWED), _cache()),  # a windowed model
                       (_cfg(attn_logit_softcap=30.0), _cache()),  # soft-capped
                       (_cfg(), _cache(kv_dtype=jnp.float8_e4m3fn, scaled=True))]:  # FP8 KV
        assert _summary(cfg, cache) == expect(special)
    # Shapes the GPU kernels cannot tile (head_dim 48) stay on xla; float32 compute keeps
    # Mosaic GPU (bf16/f16 only) out of decode buckets.
    assert _summary(_cfg(head_dim=48, hidden_size=192),
                    {"k": jax.ShapeDtypeStruct((64, 16, 2, 48), jnp.bfloat16)}) == expect(
                        ("xla", "xla"))
    if verified:
        assert _summary(_cfg(), _cache(kv_dtype=jnp.float32), dtype=jnp.float32)["decode"] != [
            "mosaic_gpu"]


def test_explicit_and_cpu_resolution(monkeypatch):
    _gpu(monkeypatch, pallas="deprecated", triton=None, mosaic_verified=True)
    # Off the GPU "auto" is the compiled CPU kernel whatever GPU kernels are installed
    # (xla where the kernel cannot build, or cannot read the pages); an explicit choice is
    # itself.
    assert _summary(_cfg(), _cache(), platform="cpu") == {"decode": ["cpu"], "prefill": ["cpu"]}
    monkeypatch.setattr(cpu_build, "kernels_unavailable", lambda: "no compiler")
    assert _summary(_cfg(), _cache(), platform="cpu") == {"decode": ["xla"], "prefill": ["xla"]}
    for impl in ("xla", "cpu", "pallas_gpu", "triton"):
        assert _summary(_cfg(), _cache(), impl=impl) == {"decode": [impl], "prefill": [impl]}


def _report(cfg, cache, *, dtype=jnp.bfloat16) -> dict:
    """The attention report of every bucket of a small ladder on a simulated GPU, each
    bucket resolved and checked against the records as the runner does."""
    buckets = BucketSet.create(tile=16, max_tokens=32, max_seqs=8).all()
    choices = {(b.tokens, b.seqs, b.max_q_len): decoder.attention_choice(
        cache, cfg=cfg, attn_impl="auto", tokens=b.tokens, max_q_len=b.max_q_len, dtype=dtype,
        platform="gpu") for b in buckets}
    return attention_report("auto", {k: c.impl for k, c in choices.items()},
                            verified={k: c.verified for k, c in choices.items()})


def _simulated_gpu_with_records(monkeypatch, tmp_path) -> str:
    """A GPU host where jax_triton launches, Pallas-Triton is deprecated, the Mosaic GPU
    backend exists, and the GPU passes are the (real) records of a fresh file."""
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: "deprecated")
    monkeypatch.setattr(backends, "triton_unavailable", lambda: None)
    monkeypatch.setattr(backends, "mosaic_gpu_unavailable", lambda: None)
    monkeypatch.setattr(backends, "device_kind", lambda: "NVIDIA H200")
    path = str(tmp_path / "verified_kernels.json")
    monkeypatch.setenv(backends.verified.ENV, path)
    return path


def test_auto_without_records_reports_unverified_and_the_command(monkeypatch, tmp_path):
    _simulated_gpu_with_records(monkeypatch, tmp_path)
    report = _report(_cfg(), _cache())
    assert report["decode"] == ["triton"] and report["prefill"] == ["triton"]
    assert report["verified"] is False and report["unverified"] == ["triton"]
    assert report["verify_command"] == backends.verified.VERIFY_COMMAND
    assert all(b["verified"] is False for b in report["buckets"])
    # Records for this shape class (D=64, 16-token pages, GQA 2) vouch for the Triton
    # kernel; a record of Mosaic GPU's decode pass moves the decode buckets to it.
    shape = backends.verified.ShapeClass(head_dim=64, page_size=16, gqa=2)
    explicit = dict(head_dim=64, block_size=16, max_q_len=None, num_heads=4, num_kv_heads=2)
    assert pallas_kernels.choose_impl("triton", **explicit).verified is False
    assert pallas_kernels.choose_impl("xla", **explicit).verified is None  # nothing to verify
    backends.verified.record_pass("triton", "NVIDIA H200", {shape: 4})
    report = _report(_cfg(), _cache())
    assert report["verified"] is True and "verify_command" not in report
    assert report["decode"] == ["triton"]
    assert pallas_kernels.choose_impl("triton", **explicit).verified is True  # named, too
    backends.verified.record_pass("mosaic_gpu", "NVIDIA H200", {shape: 2})
    report = _report(_cfg(), _cache())
    assert report["decode"] == ["mosaic_gpu"] and report["prefill"] == ["triton"]
    assert report["verified"] is True
    # Another shape class (a windowed model; FP8 pages) is not vouched for by them.
    for cfg, cache in [(_cfg(**WINDOWED), _cache()),
                       (_cfg(), _cache(kv_dtype=jnp.float8_e4m3fn, scaled=True))]:
        report = _report(cfg, cache)
        assert report["decode"] == ["triton"] and report["verified"] is False


def test_auto_prefers_a_verified_kernel_over_an_unverified_one(monkeypatch, tmp_path):
    _simulated_gpu_with_records(monkeypatch, tmp_path)
    monkeypatch.setattr(backends, "pallas_triton_state", lambda: "current")
    assert _report(_cfg(), _cache())["prefill"] == ["pallas_gpu"]  # today's first choice
    shape = backends.verified.ShapeClass(head_dim=64, page_size=16, gqa=2)
    backends.verified.record_pass("triton", "NVIDIA H200", {shape: 4})
    report = _report(_cfg(), _cache())
    assert report["prefill"] == ["triton"] and report["verified"] is True


def test_runner_logs_an_unverified_kernel_once(monkeypatch, tmp_path, caplog):
    _simulated_gpu_with_records(monkeypatch, tmp_path)
    llm = LLM(tiny_model_dir("LlamaForCausalLM"), **{**GEOMETRY, "attention_impl": "xla"})
    runner = llm.engine.runner
    runner.attn_impl, runner.platform = "auto", "gpu"  # resolved as on a GPU host
    runner.attention_impls.clear()
    runner.attention_verified.clear()
    with caplog.at_level("WARNING", logger="arcjax.runtime.runner"):
        for bucket in runner.buckets.all():
            runner._attention_impl(bucket)
    notes = [r.getMessage() for r in caplog.records if "verified: false" in r.getMessage()]
    assert len(notes) == 1 and backends.verified.VERIFY_COMMAND in notes[0], notes
    assert 'impl="triton"' in notes[0]
    report = attention_report(runner.attn_impl, dict(runner.attention_impls),
                              verified=dict(runner.attention_verified))
    assert report["verified"] is False and report["unverified"] == ["triton"]
    assert len(report["buckets"]) == len(runner.buckets.all())


def test_report_without_records_lists_every_compiled_bucket():
    impls = {(8, 8, 1): "mosaic_gpu", (1, 1, 1): "mosaic_gpu", (128, 8, 128): "triton"}
    report = attention_report("auto", impls)
    assert report["decode"] == ["mosaic_gpu"] and report["prefill"] == ["triton"]
    assert [b["tokens"] for b in report["buckets"]] == [1, 8, 128]
    assert all("steps" not in b for b in report["buckets"])
    assert attention_report("auto", {}) == {"configured": "auto", "decode": [], "prefill": [],
                                            "buckets": []}


# --- choosing an implementation the engine cannot run ------------------------------------
def test_engine_accepts_the_triton_kernel_and_refuses_what_cannot_run_here():
    assert "triton" in ATTENTION_IMPLS
    assert EngineConfig(attention_impl="triton").attention_impl == "triton"
    with pytest.raises(EngineConfigError, match="decode-only") as err:
        EngineConfig(attention_impl="mosaic_gpu")
    assert err.value.field == "attention_impl"
    # On this CPU machine a GPU kernel is refused when the engine is built, naming why.
    for impl in ("triton", "pallas_gpu"):
        with pytest.raises(EngineConfigError, match="runs on an NVIDIA GPU") as err:
            LLM(tiny_model_dir("LlamaForCausalLM"), **{**GEOMETRY, "attention_impl": impl})
        assert err.value.field == "attention_impl"


def test_cli_offers_the_triton_kernel():
    from arcjax.entrypoints.cli import parse_serve

    assert parse_serve(["serve", "--attention-impl", "triton"]).engine_options == {
        "attention_impl": "triton"}
    with pytest.raises(SystemExit):  # argparse refuses a choice the engine does not have
        parse_serve(["serve", "--attention-impl", "mosaic_gpu"])


def test_why_an_implementation_cannot_run(monkeypatch):
    unavailable = pallas_kernels.impl_unavailable
    assert unavailable("xla", platform="cpu") is None and unavailable("auto") is None
    assert "no interpret mode" in unavailable("mosaic_gpu", interpret=True)
    assert unavailable("pallas_gpu", interpret=True) is None
    assert "NVIDIA GPU" in unavailable("triton", platform="cpu")
    # Lowering for CUDA on a CPU host (platform not given) needs no GPU.
    _gpu(monkeypatch, pallas="absent", triton="the jax_triton package is not installed",
         mosaic_verified=False)
    assert unavailable("triton", platform="gpu") == (
        'impl="triton" cannot launch here: the jax_triton package is not installed')
    assert "no Pallas Triton backend" in unavailable("pallas_gpu", platform="gpu")
    assert unavailable("mosaic_gpu", platform="gpu") is None
    monkeypatch.setattr(backends, "triton_unavailable", lambda: None)
    assert unavailable("triton", platform="gpu") is None
    with pytest.raises(pallas_kernels.KernelArgumentError, match="^impl:"):
        unavailable("cuda")
