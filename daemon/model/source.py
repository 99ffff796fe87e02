"""Resolve a model argument (the demo name, a local folder, or a Hugging Face id) to a local folder.

Only the local Hugging Face cache is consulted: the daemon never downloads at start.
"""

from __future__ import annotations

from pathlib import Path

from moed.client.hub import HF_ALLOW_PATTERNS as PULL_PATTERNS
from moed.daemon.config import DEMO_MODEL
from moed.daemon.model.checkpoint_files import UnreadableCheckpoint, check_text_files
from moed.daemon.model.demo import demo_model_path

# What a stock mlx-lm checkpoint needs on disk: the same list `moe pull` downloads.
HF_ALLOW_PATTERNS = list(PULL_PATTERNS)


class ModelNotFound(Exception):
    pass


class ModelUnreadable(Exception):
    """The folder is there but a file moed must parse cannot be read; the message names it."""


def resolve_model(spec: str) -> Path:
    if spec == DEMO_MODEL:
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
    try:
        check_text_files(path)
    except UnreadableCheckpoint as exc:
        raise ModelUnreadable(str(exc)) from None  # fix the file: exit 8
    return path.resolve()


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
