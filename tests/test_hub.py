"""Hugging Face Hub ids, resolved offline from a cache laid out as the Hub lays it out
(models--org--name/{refs,snapshots}) with HF_HUB_OFFLINE=1: no network anywhere."""

from __future__ import annotations

import os
import shutil

import pytest

import arcjax
from arcjax.entrypoints.cli import parse_serve
from arcjax.errors import ModelFileError
from arcjax.model.formats.hub import HubModelError, resolve_model
from support.gguf_files import tiny_gguf_model_dir
from support.hf_models import hf_greedy
from support.checkpoint_cases import ENGINE, GREEDY, PROMPTS

REPO = "arcjax-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """HF_HOME with the tiny model cached as the Hub's snapshot of REPO at COMMIT ("main")."""
    repo = tmp_path / "hf" / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    src = tiny_gguf_model_dir("LlamaForCausalLM")
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return snapshot


def test_hub_id_resolves_offline_and_generates(hub_cache):
    llm = arcjax.LLM(REPO, **ENGINE)
    assert llm.model_dir == hub_cache
    outs = llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert list(out.token_ids) == hf_greedy(str(hub_cache), ids, GREEDY.max_tokens)
    assert resolve_model(REPO, revision=COMMIT).path == hub_cache


def test_offline_and_not_cached_is_a_typed_error_naming_the_id(hub_cache):
    with pytest.raises(HubModelError, match="HF_HUB_OFFLINE") as err:
        arcjax.LLM("arcjax-test/not-cached")
    assert err.value.path == "arcjax-test/not-cached"
    assert isinstance(err.value, ModelFileError) and isinstance(err.value, ValueError)
    with pytest.raises(HubModelError, match=f"{REPO} \\(revision v2\\)"):
        resolve_model(REPO, revision="v2")


def test_local_path_wins_over_the_hub_id(hub_cache, tmp_path):
    local = tmp_path / REPO  # ./arcjax-test/tiny-llama relative to the working directory
    shutil.copytree(hub_cache, local)
    assert resolve_model(REPO).path.resolve() == local.resolve()
    with pytest.raises(ModelFileError, match="no such file or directory"):
        resolve_model("./missing/dir")


def test_serve_takes_a_hub_id_and_revision(hub_cache):
    from fastapi.testclient import TestClient

    from arcjax.entrypoints.async_llm import AsyncLLM
    from arcjax.entrypoints.openai.api_server import OpenAIServer

    cmd = parse_serve(["serve", REPO, "--revision", COMMIT, "--quantization", "int8",
                       "--kv-cache-dtype", "fp8"])
    assert cmd.model_dir == REPO
    assert cmd.engine_options == {"revision": COMMIT, "quantization": "int8",
                                  "kv_cache_dtype": "fp8"}
    llm = AsyncLLM(REPO, revision=COMMIT, **ENGINE)
    try:
        server = OpenAIServer(llm)
        card = TestClient(server.app).get("/v1/models").json()["data"][0]
        assert card["id"] == REPO
        assert card["weight_dtype"] == "float32" and card["kv_cache_dtype"] == "float32"
        cfg = llm.engine.runner.cfg  # per-head K and V of every layer, float32
        assert card["kv_layout"] == "per_head" and card["kv_bytes_per_token"] == (
            cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4)
        server.close()
    finally:
        llm.shutdown()
