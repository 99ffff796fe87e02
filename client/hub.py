"""Models in the local Hugging Face cache: pull what mlx-lm needs (with progress, headers verified),
list what moed can serve, remove. The daemon never downloads; this is the client's job.

Imports no mlx: whether mlx-lm knows an architecture is read from its package folder, not imported.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moed.protocol.model_config import ModelConfig

from .hub_names import UnsafeName, check_repo_id, check_revision
from .hub_verify import (
    MAX_CONFIG_BYTES,
    PullError,
    read_json_file,
    verify_checkpoint,
    verify_safetensors,
)

if TYPE_CHECKING:  # types only: pull imports them when it runs (the Hub client costs start-up)
    from .hub_remote import HubFile
    from .hub_store import RepoCache

__all__ = ["PullError", "pull", "verify_checkpoint", "verify_safetensors", "wanted"]

# What a stock mlx-lm checkpoint needs on disk (the patterns mlx-lm itself downloads). The daemon
# resolves Hugging Face ids with the same list.
HF_ALLOW_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
)
# Files moed parses itself: bounded before a byte is downloaded.
PARSED_FILES = ("config.json", "model.safetensors.index.json")


def wanted(filename: str) -> bool:
    return any(fnmatch.fnmatch(filename, p) for p in HF_ALLOW_PATTERNS)


# ---- pull ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PullResult:
    repo_id: str
    commit: str
    path: Path
    files: int
    total_bytes: int
    downloaded_bytes: int  # bytes that came over the network (0: all already in the cache)
    verified_shards: int


ProgressFn = Callable[[int, int, str], None]  # (bytes done, bytes total, current file)


def pull(
    repo_id: str, revision: str | None = None, on_progress: ProgressFn | None = None
) -> PullResult:
    """Download the files mlx-lm needs into the Hugging Face cache and verify every one.

    Nothing from the server is trusted: names, sizes and hashes from the listing are checked,
    every path is checked to stay inside the cache, every file is cut at its listed size and
    hashed. Finished files are kept; a partial one (a dropped connection, a killed pull) resumes
    with a Range request. Every failure is a PullError with one line."""
    from .hub_remote import HubClient
    from .hub_store import RepoCache, cache_root, download

    try:
        check_repo_id(repo_id)
        revision = check_revision(revision or "main")
    except UnsafeName as exc:
        raise PullError(str(exc)) from None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise PullError(f"{repo_id}: HF_HUB_OFFLINE is set; unset it to pull")
    report = on_progress or (lambda *_: None)
    try:
        with HubClient() as client:
            listing = client.listing(repo_id, revision)
            files = [f for f in listing.files if wanted(f.name)]
            _check_listing(repo_id, files)
            cache = RepoCache(cache_root(), repo_id)
            cache.clean_partials({f.blob_id for f in files})
            total = sum(f.size for f in files)
            cached = sum(f.size for f in files if cache.cached(listing.commit, f))
            done, fetched = cached, 0
            report(done, total, "")
            for f in files:
                if cache.cached(listing.commit, f):
                    continue
                start = done

                def count(n: int, name: str = f.name) -> None:
                    nonlocal done
                    done += n
                    report(done, total, name)

                fetched += download(client, repo_id, listing.commit, f, cache, count)
                done = start + f.size
                cache.link(listing.commit, f)
            cache.write_ref(revision, listing.commit)
            folder = cache.snapshot(listing.commit)
    except UnsafeName as exc:
        raise PullError(f"{repo_id}: {exc}") from None
    except OSError as exc:  # the cache cannot be written: disk full, permissions
        raise PullError(f"{repo_id}: writing the cache failed ({exc})") from None
    shards = _verify(repo_id, folder, files, cache, listing.commit)
    report(total, total, "")
    return PullResult(repo_id, listing.commit, folder, len(files), total, fetched, shards)


def _check_listing(repo_id: str, files: list[HubFile]) -> None:
    names = {f.name: f for f in files}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise PullError(
            f"{repo_id!r} has no config.json and model*.safetensors: not an mlx-lm checkpoint "
            "(look for an mlx-community conversion)"
        )
    for name in PARSED_FILES:
        if name in names and names[name].size > MAX_CONFIG_BYTES:
            raise PullError(
                f"{repo_id}: the Hub lists {name} at {names[name].size} bytes, over the "
                f"{MAX_CONFIG_BYTES}-byte limit: not a real {name}"
            )


def _verify(repo_id: str, folder: Path, files: list[HubFile], cache: RepoCache, commit: str) -> int:
    try:
        read_json_file(folder / "config.json")
        return verify_checkpoint(folder)
    except PullError as exc:
        # Drop the damaged blobs, so that the next pull fetches them again instead of trusting them.
        for f in files:
            if f.name in str(exc):
                (folder / f.name).unlink(missing_ok=True)
                cache.blob(f.blob_id).unlink(missing_ok=True)
        raise PullError(
            f"{repo_id}: {exc} (removed; run the pull again to fetch it anew)"
        ) from None


# ---- what is in the cache ------------------------------------------------------------------


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    path: Path  # the newest snapshot
    size_bytes: int
    model_type: str | None
    num_experts: int | None  # routed experts per MoE layer; None for a dense model
    experts_per_token: int | None
    servable: bool
    why_not: str | None  # when not servable
    builtin: bool = False  # the demo that ships inside moed (`--model demo`, the default)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.repo_id,
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "model_type": self.model_type,
            "moe": self.is_moe,
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "servable": self.servable,
            "why_not": self.why_not,
            "builtin": self.builtin,
        }


def mlx_lm_knows(model_type: str) -> bool:
    """Whether the installed mlx-lm has this architecture (models/<type>.py); imports nothing."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(
        (Path(loc) / "models" / f"{model_type}.py").exists()
        for loc in spec.submodule_search_locations
    )


def describe_folder(repo_id: str, folder: Path, size_bytes: int) -> CachedModel:
    why = None
    config = ModelConfig.from_dict({})
    try:  # bounded: never a 1 GiB load
        config = ModelConfig.from_dict(read_json_file(folder / "config.json"))
    except PullError as exc:
        why = str(exc)
    model_type, experts, top_k = config.model_type, config.num_experts, config.experts_per_token
    if why is None and not any(folder.glob("model*.safetensors")):
        why = "no model*.safetensors"
    if why is None and not (model_type and model_type.isidentifier() and mlx_lm_knows(model_type)):
        why = f"mlx-lm has no {model_type!r} architecture"
    return CachedModel(repo_id, folder, size_bytes, model_type, experts, top_k, why is None, why)


DEMO_NAME = "demo"  # what `--model` takes for it


def demo_model() -> CachedModel | None:
    """The demo checkpoint that ships inside the package (moed.daemon.model.demo_model, data
    only): found beside this package, as the editable layout and the wheel both place it, so
    `moe` never imports the daemon."""
    folder = Path(__file__).resolve().parent.parent / "daemon" / "model" / "demo_model"
    if not (folder / "config.json").is_file():
        return None
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return dataclasses.replace(describe_folder(DEMO_NAME, folder, size), builtin=True)


def cached_models() -> list[CachedModel]:
    """Every model repo in the local Hugging Face cache (newest snapshot), servable or not."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        out.append(describe_folder(repo.repo_id, Path(newest.snapshot_path), repo.size_on_disk))
    return out


def remove(repo_id: str) -> tuple[int, Path]:
    """Delete every revision of a cached model: (bytes freed, its folder); KeyError if absent."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        raise KeyError(repo_id) from None
    for repo in cache.repos:
        if repo.repo_type == "model" and repo.repo_id == repo_id:
            strategy = cache.delete_revisions(*(r.commit_hash for r in repo.revisions))
            strategy.execute()
            if repo.repo_path.exists():  # refs and .no_exist markers of a fully deleted repo
                shutil.rmtree(repo.repo_path, ignore_errors=True)
            return repo.size_on_disk, Path(repo.repo_path)
    raise KeyError(repo_id)
