"""Resolve a model argument (the demo name, a local folder, or a Hugging Face id) to a local folder.

Only the local Hugging Face cache is consulted: the daemon never downloads at start.
"""

from __future__ import annotations

from pathlib import Path

from moed.client.hub import HF_ALLOW_PATTERNS as PULL_PATTERNS
from moed.daemon.config import DEMO_MODEL

# What a stock mlx-lm checkpoint needs on disk: the same list `moe pull` downloads.
HF_ALLOW_PATTERNS = list(PULL_PATTERNS)


class ModelNotFound(Exception):
    pass


class ModelUnreadable(Exception):
    """The folder is there but a file moed must parse cannot be read; the message names it."""


def resolve_model(spec: str) -> Path:
    if spec == DEMO_MODEL:
        from moed.daemon.model.demo import demo_model_path

        return _check_folder(demo_model_path(), spec)
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")):
        return _check_folder(path, spec)
    if spec.count("/") == 1:
        return _from_hf_cache(spec)
    raise ModelNotFound(f"model {spec!r} is neither a folder nor a Hugging Face id (org/name)")


def _check_folder(path: Path, spec: str) -> Path:
    if not path.is_dir():
        raise ModelNotFound(f"model folder {spec!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"model folder {spec!r} has no config.json")
    if not any(path.glob("model*.safetensors")):
        raise ModelNotFound(f"model folder {spec!r} has no model*.safetensors weights")
    _check_config(path / "config.json")
    return path.resolve()


def _check_config(config: Path) -> None:
    """Read once here, bounded, so that a config that is not UTF-8 JSON is one line naming it,
    never a UnicodeDecodeError deep in the load."""
    from moed.client.hub_verify import PullError, read_json_file

    try:
        read_json_file(config)
    except PullError as exc:
        raise ModelUnreadable(f"{config}: {exc}") from None


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, local_files_only=True, allow_patterns=HF_ALLOW_PATTERNS)
    except LocalEntryNotFoundError:
        raise ModelNotFound(
            f"{repo_id!r} is not in the local Hugging Face cache; download it first with "
            f"`moe pull {repo_id}` (the daemon never downloads)"
        ) from None
    except Exception as exc:  # invalid repo id, corrupt cache
        raise ModelNotFound(f"{repo_id!r}: {exc}") from None
    return _check_folder(Path(folder), repo_id)
