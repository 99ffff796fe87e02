"""Models in the local Hugging Face cache: pull what mlx-lm needs (with progress, headers verified),
list what moed can serve, remove. The daemon never downloads; this is the client's job.

Imports no mlx: whether mlx-lm knows an architecture is read from its package folder, not imported.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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

# A safetensors header is a JSON map; anything larger than this is not a header but damage.
MAX_HEADER_BYTES = 100_000_000
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class PullError(Exception):
    """The model cannot be pulled (not found, not an mlx-lm checkpoint, or damaged on arrival)."""


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
    downloaded_bytes: int  # 0 when everything was already in the cache
    verified_shards: int


ProgressFn = Callable[[int, int, str], None]  # (bytes done, bytes total, current file)


def pull(repo_id: str, revision: str | None = None, on_progress: ProgressFn | None = None):
    """Download the files mlx-lm needs into the Hugging Face cache and verify every shard.

    Files already in the cache are skipped (a pull interrupted after some shards resumes there);
    a dropped connection within a file resumes with an HTTP Range request (huggingface_hub)."""
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    except GatedRepoError:
        raise PullError(
            f"{repo_id!r} is gated: accept its terms on the Hub, then set HF_TOKEN"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise PullError(f"{repo_id!r} is not on the Hub ({exc.__class__.__name__})") from None
    except (HfHubHTTPError, OSError) as exc:
        raise PullError(f"{repo_id!r}: the Hub did not answer ({exc})") from None
    siblings = info.siblings or []
    files = sorted((s.rfilename, int(s.size or 0)) for s in siblings if wanted(s.rfilename))
    names = [name for name, _ in files]
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise PullError(
            f"{repo_id!r} has no config.json and model*.safetensors: not an mlx-lm checkpoint "
            "(look for an mlx-community conversion)"
        )
    total = sum(size for _, size in files)
    done = sum(
        size
        for name, size in files
        if isinstance(try_to_load_from_cache(repo_id, name, revision=info.sha), str)
    )
    cached = done
    report = on_progress or (lambda *_: None)
    report(done, total, "")

    class FileBytes:
        """The tqdm stand-in huggingface_hub drives per file; it feeds the one pull-wide count."""

        def __init__(self, *_, initial: int = 0, desc: str = "", **__):
            nonlocal done
            self.desc = desc
            done += initial
            report(done, total, desc)

        def update(self, n: int | float | None = 1) -> None:
            nonlocal done
            done += int(n or 0)
            report(done, total, self.desc)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def close(self) -> None:
            pass

        def set_postfix_str(self, *_, **__) -> None:
            pass

    local: dict[str, Path] = {}
    for name, _ in files:
        try:
            local[name] = Path(
                hf_hub_download(repo_id, name, revision=revision or "main", tqdm_class=FileBytes)
            )
        except (HfHubHTTPError, OSError) as exc:
            raise PullError(
                f"{repo_id}: downloading {name} failed ({exc}); run the pull again to resume"
            ) from None
    folder = local["config.json"].parent
    try:
        shards = verify_checkpoint(folder)
    except PullError as exc:
        # Drop the damaged blobs, so that the next pull fetches them again instead of trusting them.
        for name, path in local.items():
            if name.endswith(".safetensors") and path.name in str(exc):
                path.resolve().unlink(missing_ok=True)
                path.unlink(missing_ok=True)
        raise PullError(f"{exc} (removed; run the pull again to fetch it anew)") from None
    report(total, total, "")
    return PullResult(repo_id, info.sha, folder, len(files), total, total - cached, shards)


# ---- verification --------------------------------------------------------------------------------


def verify_safetensors(path: Path) -> int:
    """Check a shard's header against its size: every tensor inside the file, the data region
    exactly covered. Returns the tensor count; raises PullError naming the damage."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PullError(f"{path.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise PullError(f"{path.name}: header length {n} does not fit a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise PullError(f"{path.name}: the header is not JSON ({exc})") from None
    data_bytes = size - 8 - n
    end_max = 0
    tensors = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            width = DTYPE_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise PullError(f"{path.name}: tensor {name!r} has a malformed entry") from None
        if not 0 <= begin <= end <= data_bytes or end - begin != count * width:
            raise PullError(
                f"{path.name}: tensor {name!r} at bytes {begin}-{end} does not fit its shape or "
                f"the file ({data_bytes} data bytes): truncated or damaged"
            )
        end_max = max(end_max, end)
        tensors += 1
    if end_max != data_bytes:
        raise PullError(
            f"{path.name}: tensors cover {end_max} of {data_bytes} data bytes: truncated or damaged"
        )
    return tensors


def verify_checkpoint(folder: Path) -> int:
    """Every shard's header is sound and the index names only shards that are there."""
    shards = sorted(folder.glob("model*.safetensors"))
    if not shards:
        raise PullError(f"{folder}: no model*.safetensors")
    for shard in shards:
        verify_safetensors(shard)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (folder / f).exists()})
        if missing:
            raise PullError(f"{folder.name}: the index names missing shards {missing}")
    return len(shards)


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

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def to_json(self) -> dict:
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
        }


def moe_shape(config: dict) -> tuple[int | None, int | None]:
    """(routed experts, experts per token) from a config.json; (None, None) for a dense model."""
    merged = {**config, **(config.get("text_config") or {})}
    experts = next(
        (
            merged[k]
            for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
            if isinstance(merged.get(k), int) and merged[k] > 1
        ),
        None,
    )
    top_k = next(
        (
            merged[k]
            for k in ("num_experts_per_tok", "experts_per_token", "moe_top_k")
            if isinstance(merged.get(k), int)
        ),
        None,
    )
    return experts, (top_k if experts else None)


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
    config: dict = {}
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        why = "no readable config.json"
    model_type = config.get("model_type")
    experts, top_k = moe_shape(config)
    if why is None and not any(folder.glob("model*.safetensors")):
        why = "no model*.safetensors"
    if why is None and not (model_type and mlx_lm_knows(model_type)):
        why = f"mlx-lm has no {model_type!r} architecture"
    return CachedModel(repo_id, folder, size_bytes, model_type, experts, top_k, why is None, why)


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
