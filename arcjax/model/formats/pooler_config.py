"""How an embedding model pools its hidden states (`PoolerConfig`), read from the model's
sentence-transformers files.

1. `modules.json` lists the sentence-transformers pipeline: a `Transformer` (the decoder),
   a `Pooling` module whose directory holds `config.json` (`1_Pooling/config.json`: one of
   `pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`), and
   optionally `Normalize` (L2 normalization of the pooled vector). Any other module (a
   `Dense` projection, ...) or pooling mode is refused by name: its output would differ.
2. Without `modules.json` (a plain decoder LM asked to embed, a GGUF file) the pooling is
   vLLM's default for a decoder: the last token's hidden state, normalized.
3. Matryoshka truncation (`PoolingParams.dimensions`) is allowed where the model's
   config.json says so: `matryoshka_dimensions` (the sizes it was trained for) or
   `is_matryoshka: true` (any size up to the hidden size), as vLLM reads them.

The pooled hidden states are the last layer's after the final norm: what a
sentence-transformers `Transformer` module hands its `Pooling` module.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from arcjax.errors import ModelConfigError

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config flags -> our pooling type
_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
          "pooling_mode_cls_token": "CLS"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")
_ST = "sentence_transformers.models."
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolerConfig:
    """An embedding model's pooling.

    Attributes:
      pooling_type: "LAST" (the last prompt token's hidden state), "MEAN" (the mean over
        every prompt token) or "CLS" (the first token's).
      normalize: the pooled vector is L2-normalized (a request may ask otherwise).
      matryoshka_dimensions: the sizes `dimensions` may take (None: any size up to the
        hidden size when `is_matryoshka`, else none).
      is_matryoshka: the model allows `dimensions` (truncation before normalization).
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = None
    is_matryoshka: bool = False

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got "
                             f"{self.pooling_type!r}")


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelConfigError(path, f"cannot be read as JSON ({e})") from None


def _pooling_type(path: Path) -> str:
    """The pooling type of a sentence-transformers `Pooling` module's config.json."""
    cfg = _json(path)
    if not isinstance(cfg, dict):
        raise ModelConfigError(path, "must be a JSON object")
    for flag in _UNSUPPORTED_MODES:
        if cfg.get(flag):
            raise ModelConfigError(path, f"{flag} is not supported (supported: "
                                         f"{sorted(_MODES)})")
    if cfg.get("include_prompt", True) is not True:
        raise ModelConfigError(path, "include_prompt false is not supported")
    modes = [kind for flag, kind in _MODES.items() if cfg.get(flag)]
    if len(modes) != 1:
        raise ModelConfigError(path, f"exactly one of {sorted(_MODES)} must be true, got "
                                     f"{modes or 'none'}")
    return modes[0]


def _matryoshka(model_config: dict) -> tuple[tuple[int, ...] | None, bool]:
    dims = model_config.get("matryoshka_dimensions")
    if dims is not None:
        if not isinstance(dims, list) or not dims or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
            raise ModelConfigError("config.json", f"matryoshka_dimensions must be a list of "
                                                  f"ints >= 1, got {dims!r}")
        return tuple(dims), True
    flag = model_config.get("is_matryoshka", False)
    if not isinstance(flag, bool):
        raise ModelConfigError("config.json", f"is_matryoshka must be a boolean, got {flag!r}")
    return None, flag


def read_pooler_config(model_dir: Path | None) -> PoolerConfig:
    """The pooling of the model in `model_dir` (a Hugging Face directory; a GGUF file or
    None: the decoder default). See the module docstring.

    Raises:
      ModelConfigError: modules.json or the Pooling config names what arcjax cannot run.
    """
    if model_dir is None or not Path(model_dir).is_dir():
        return PoolerConfig()
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    model_config = _json(config_path) if config_path.is_file() else {}
    dims, matryoshka = _matryoshka(model_config if isinstance(model_config, dict) else {})
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return PoolerConfig(matryoshka_dimensions=dims, is_matryoshka=matryoshka)
    modules = _json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelConfigError(modules_path, "must be a list of module objects")
    pooling_type, normalize = None, False
    for m in modules:
        kind = str(m.get("type", ""))
        name = kind.removeprefix(_ST)
        if kind != _ST + name or name not in _KNOWN_MODULES:
            raise ModelConfigError(modules_path, f"module {kind!r} is not supported "
                                                 f"(supported: {list(_KNOWN_MODULES)})")
        if name == "Pooling":
            pooling_type = _pooling_type(model_dir / str(m.get("path", "")) / "config.json")
        normalize = normalize or name == "Normalize"
    if pooling_type is None:
        raise ModelConfigError(modules_path, "lists no sentence_transformers Pooling module")
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize,
                        matryoshka_dimensions=dims, is_matryoshka=matryoshka)
