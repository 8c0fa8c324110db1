"""Training a small decoder on the Python standard library (the packaged default model).

1. `corpus_files(root)`: the interpreter's own stdlib *.py files (test directories and
   site-packages skipped), as sorted POSIX relative paths. Read at training time, never stored.
2. `is_held_out(rel_path)`: a file-level split by hash of the relative path, so it is the same on
   every machine and does not depend on file order.
3. `train_bpe(texts)`: a byte-level BPE tokenizer; `<|endoftext|>` is both BOS and EOS and the
   post-processor puts it in front of every encoded text.
4. `token_stream(tok, texts)`: `<|endoftext|> doc <|endoftext|> doc ...` as one int32 array, cut
   into windows of seq_len + 1; the batch of step s is a pure function of (seed, s), so a run
   resumed from a checkpoint sees the same batches as an uninterrupted one.
5. `train(cfg)`: AdamW (warm-up + cosine decay, global-norm clipping) on `model.forward_dense`,
   orbax checkpoints every `checkpoint_every` steps with resume, held-out perplexity at the end,
   and export in Hugging Face format.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from arcjax import model
from arcjax.model.formats import hf_checkpoint
from arcjax.model.model_config import ModelConfig

EOT = "<|endoftext|>"
_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    out_dir: str = "runs/default_model"  # checkpoints, tokenizer and log of this run
    export_dir: str = ""  # Hugging Face-format model written here at the end ("" = skip)
    export_dtype: str = "bfloat16"
    corpus_dir: str = ""  # "" = this interpreter's stdlib
    held_out_fraction: float = 0.05
    seed: int = 0
    # Tokenizer.
    vocab_size: int = 4096
    # Model (Llama architecture).
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 704
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    # Optimisation.
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 2000
    warmup_steps: int = 100
    peak_lr: float = 3e-3
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    eval_windows: int = 256  # held-out windows of seq_len scored at the end

    def model_config(self, vocab_size: int, eot_id: int) -> ModelConfig:
        return ModelConfig(
            architecture="LlamaForCausalLM", vocab_size=vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
            rms_norm_eps=1e-5, tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=max(self.seq_len, 2048), bos_token_id=eot_id,
            eos_token_ids=(eot_id,))


# --- corpus -------------------------------------------------------------------------------------

def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def corpus_files(root: str | os.PathLike) -> list[str]:
    """Sorted POSIX paths (relative to root) of the *.py files, test dirs skipped."""
    root = Path(root)
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if not _SKIP_DIRS.intersection(rel.parts[:-1]) and p.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def is_held_out(rel_path: str, fraction: float) -> bool:
    """Deterministic file-level split: hash of the relative path below `fraction`."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h < fraction * 2**64


def read_texts(root: str | os.PathLike, rel_paths: Sequence[str]) -> list[str]:
    root = Path(root)
    return [(root / r).read_text(encoding="utf-8", errors="replace") for r in rel_paths]


def split_corpus(root: str | os.PathLike, fraction: float) -> tuple[list[str], list[str]]:
    """(train, held-out) relative paths."""
    files = corpus_files(root)
    held = [f for f in files if is_held_out(f, fraction)]
    return [f for f in files if not is_held_out(f, fraction)], held


# --- tokenizer ----------------------------------------------------------------------------------

def train_bpe(texts: Sequence[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level BPE with `<|endoftext|>` (id 0) as BOS/EOS, prepended on encode."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    eot = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot)])
    return tok


def write_tokenizer_files(tok: tokenizers.Tokenizer, out_dir: str | os.PathLike,
                          max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json for a HF model dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
            "unk_token": None, "add_bos_token": True, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": max_length}
    gen = {"bos_token_id": eot, "eos_token_id": eot, "do_sample": True, "temperature": 0.8,
           "top_p": 0.95}
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# --- data ---------------------------------------------------------------------------------------

def token_stream(tok: tokenizers.Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """`<|endoftext|> doc <|endoftext|> doc ...` as int32 (the post-processor adds each BOS)."""
    encs = tok.encode_batch(list(texts), add_special_tokens=True)
    return np.concatenate([np.asarray(e.ids, np.int32) for e in encs])


def num_windows(stream: np.ndarray, seq_len: int) -> int:
    return (len(stream) - 1) // seq_len


def window(stream: np.ndarray, seq_len: int, i: int) -> np.ndarray:
    """Window i: seq_len + 1 tokens (inputs and shifted targets)."""
    return stream[i * seq_len:(i + 1) * seq_len + 1]


def batch_at(stream: np.ndarray, cfg: TrainConfig, step: int) -> np.ndarray:
    """The [B, seq_len + 1] batch of `step`: window order is reshuffled every epoch from the seed."""
    n = num_windows(stream, cfg.seq_len)
    flat = step * cfg.batch_size + np.arange(cfg.batch_size)
    rows = []
    for epoch, pos in zip(flat // n, flat % n):
        order = _epoch_order(cfg.seed, int(epoch), n)
        rows.append(window(stream, cfg.seq_len, int(order[pos])))
    return np.stack(rows)


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


# --- training -----------------------------------------------------------------------------------

def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up, cosine decay to final_lr_ratio * peak_lr, global-norm clipping."""
    return _optimizer(cfg.peak_lr, cfg.warmup_steps, cfg.steps, cfg.final_lr_ratio,
                      cfg.weight_decay, cfg.grad_clip)


# NOTE: cached so equal settings give the same object: it is a static argument of train_step,
# and a new object would recompile it.
@functools.lru_cache(maxsize=8)
def _optimizer(peak_lr, warmup_steps, steps, final_lr_ratio, weight_decay, grad_clip):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak_lr, warmup_steps=warmup_steps, decay_steps=steps,
        end_value=peak_lr * final_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norms
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask))


def mean_nll(params, mcfg: ModelConfig, batch: jax.Array) -> jax.Array:
    """Mean next-token negative log-likelihood of batch [B, L + 1]."""
    logits = model.forward_dense(params, mcfg, batch[:, :-1])  # [B, L, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@functools.partial(jax.jit, static_argnames=("mcfg", "opt"), donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, batch, *, mcfg: ModelConfig, opt: optax.GradientTransformation):
    loss, grads = jax.value_and_grad(mean_nll)(params, mcfg, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


eval_nll = jax.jit(mean_nll, static_argnames=("mcfg",))


def held_out_nll(params, mcfg: ModelConfig, stream: np.ndarray, seq_len: int,
                 max_windows: int, batch_size: int) -> float:
    """Mean NLL per token over the first `max_windows` held-out windows."""
    n = min(num_windows(stream, seq_len), max_windows)
    n -= n % batch_size
    if n == 0:
        raise ValueError(f"held-out stream too short for one batch of {batch_size}x{seq_len}")
    total = 0.0
    for i in range(0, n, batch_size):
        batch = np.stack([window(stream, seq_len, j) for j in range(i, i + batch_size)])
        total += float(eval_nll(params, mcfg, jnp.asarray(batch)))
    return total / (n // batch_size)


def train(cfg: TrainConfig, *, log=print) -> dict:
    """Runs (or resumes) training; returns the final metrics. See the module docstring."""
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    out = Path(cfg.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    root = cfg.corpus_dir or stdlib_dir()
    train_files, held_files = split_corpus(root, cfg.held_out_fraction)
    log(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files")
    train_texts, held_texts = read_texts(root, train_files), read_texts(root, held_files)

    tok_path = out / "tokenizer.json"
    if tok_path.exists():  # resume: the ids must not change under the checkpoint
        tok = tokenizers.Tokenizer.from_file(str(tok_path))
    else:
        t0 = time.time()
        tok = train_bpe(train_texts, cfg.vocab_size)
        tok.save(str(tok_path))
        log(f"tokenizer: {tok.get_vocab_size()} ids trained in {time.time() - t0:.1f}s")
    train_stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    train_bytes = sum(len(t.encode()) for t in train_texts)
    log(f"tokens: {len(train_stream)} train ({train_bytes / len(train_stream):.2f} bytes/token), "
        f"{len(held_stream)} held-out; {cfg.steps * cfg.batch_size * cfg.seq_len / len(train_stream):.2f} "
        "epochs planned")

    mcfg = cfg.model_config(tok.get_vocab_size(), tok.token_to_id(EOT))
    opt = make_optimizer(cfg)
    params = model.init_params(mcfg, jax.random.key(cfg.seed))
    opt_state = opt.init(params)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    log(f"model: {n_params / 1e6:.2f}M params, {mcfg}")

    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=cfg.checkpoint_every)
    start = 0
    with ocp.CheckpointManager(out / "checkpoints", options=options) as mngr:
        if mngr.latest_step() is not None:
            start = mngr.latest_step()
            state = mngr.restore(start, args=ocp.args.StandardRestore(
                {"params": params, "opt_state": opt_state}))
            params, opt_state = state["params"], state["opt_state"]
            log(f"resumed from step {start}")
        tokens_per_step = cfg.batch_size * cfg.seq_len
        bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, mininterval=5,
                   smoothing=0.05)
        t0, losses = time.time(), []
        for step in bar:
            batch = jnp.asarray(batch_at(train_stream, cfg, step))
            params, opt_state, loss = train_step(params, opt_state, batch, mcfg=mcfg, opt=opt)
            losses.append(loss)
            if (step + 1) % 10 == 0 or step + 1 == cfg.steps:
                mean_loss = float(np.mean(jax.device_get(losses)))  # waits for the step
                elapsed = time.time() - t0
                bar.set_postfix(loss=f"{mean_loss:.3f}",
                                tok_s=f"{(step + 1 - start) * tokens_per_step / elapsed:.0f}",
                                refresh=False)
                losses = []
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                mngr.save(step + 1, args=ocp.args.StandardSave(
                    {"params": params, "opt_state": opt_state}), force=step + 1 == cfg.steps)
        bar.close()
        train_s = time.time() - t0
        mngr.wait_until_finished()

    held_bytes = sum(len(t.encode()) for t in held_texts)
    nll = held_out_nll(params, mcfg, held_stream, cfg.seq_len, cfg.eval_windows, cfg.batch_size)
    metrics = {
        "steps": cfg.steps, "resumed_from": start, "train_seconds": round(train_s, 1),
        "tokens_per_second": round((cfg.steps - start) * tokens_per_step / max(train_s, 1e-9), 1),
        "held_out_nll": nll, "held_out_perplexity": math.exp(nll),
        "held_out_bits_per_byte": nll / math.log(2) * len(held_stream) / held_bytes,
        "params": int(n_params),
    }
    if cfg.export_dir:
        export_dtype = jnp.dtype(cfg.export_dtype)
        hf_checkpoint.save_hf(params, mcfg, cfg.export_dir, dtype=export_dtype)
        write_tokenizer_files(tok, cfg.export_dir, max_length=mcfg.max_position_embeddings)
        rounded = jax.tree.map(lambda p: p.astype(export_dtype).astype(jnp.float32), params)
        nll_x = held_out_nll(rounded, mcfg, held_stream, cfg.seq_len, cfg.eval_windows,
                             cfg.batch_size)
        metrics["exported_held_out_perplexity"] = math.exp(nll_x)
    log(json.dumps(metrics))
    (out / "metrics.json").write_text(json.dumps({**metrics, "config": dataclasses.asdict(cfg)},
                                                 indent=2) + "\n")
    return metrics
