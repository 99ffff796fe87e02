"""One repo's part of the Hugging Face cache, written by `moe pull` in huggingface_hub's layout
(`models--org--name/{blobs,snapshots,refs}`, so that the daemon, `moe list` and every Hugging Face
tool read it), with moed's own checks on what lands where.

- Every directory and file is checked to lie inside the cache after resolving (a symlink planted in
  the cache, or a name from the server, can never send a write elsewhere).
- A file is written to `blobs/<hash>.incomplete` as it arrives (unbuffered), cut at the size the
  listing announced, hashed (sha256 for LFS, the git blob hash otherwise) and renamed only when
  the hash matches: a killed pull leaves the partial file, and the next one resumes from it with a
  Range request; partial files of blobs the revision no longer has are removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Callable
from io import FileIO
from pathlib import Path
from typing import Protocol

from .hub_names import UnsafeName, check_repo_id, inside
from .hub_remote import NETWORK_ERRORS, HashKind, HubClient, HubFile, network_error
from .hub_verify import PullError

PARTIAL = ".incomplete"
ATTEMPTS = 5  # connections in a row that bring no byte before a pull gives up on a file


def cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def make_dirs(root: Path, path: Path) -> Path:
    """mkdir -p, one level at a time, refusing any level that resolves outside `root`."""
    root.mkdir(parents=True, exist_ok=True)
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        inside(root, current)  # an existing symlink is judged before anything is created in it
        current.mkdir(exist_ok=True)
        inside(root, current)
    return current


class RepoCache:
    def __init__(self, root: Path, repo_id: str):
        org, name = check_repo_id(repo_id).split("/")
        self.root = root
        self.folder = root / f"models--{org}--{name}"

    def blob(self, blob_id: str) -> Path:
        return inside(self.root, make_dirs(self.root, self.folder / "blobs") / blob_id)

    def snapshot(self, commit: str) -> Path:
        return make_dirs(self.root, self.folder / "snapshots" / commit)

    def cached(self, commit: str, f: HubFile) -> bool:
        """The snapshot's link leads to this blob, complete (its hash was checked when written)."""
        link = self.folder / "snapshots" / commit / f.name
        try:
            target = inside(self.root, link)
            blob = self.blob(f.blob_id)
        except UnsafeName:
            return False  # a link out of the cache is replaced, never followed
        return target == blob and blob.is_file() and blob.stat().st_size == f.size

    def link(self, commit: str, f: HubFile) -> None:
        link = self.snapshot(commit) / f.name
        parent = make_dirs(self.root, link.parent)
        target = os.path.relpath(self.blob(f.blob_id), parent)
        if link.is_symlink() and os.readlink(link) == target:
            return
        tmp = parent / f".{link.name}.moed-link"
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, link)

    def write_ref(self, revision: str, commit: str) -> None:
        if revision == commit:
            return
        ref = self.folder / "refs" / revision
        parent = make_dirs(self.root, ref.parent)
        tmp = parent / f".{ref.name}.moed-tmp"
        tmp.unlink(missing_ok=True)
        tmp.write_text(commit)
        os.replace(tmp, inside(self.root, parent / ref.name))

    def clean_partials(self, keep: set[str]) -> None:
        """Partial files of blobs this revision does not have would stay forever: remove them
        (unless another pull is writing one)."""
        blobs = self.folder / "blobs"
        if not blobs.is_dir():
            return
        for partial in blobs.glob(f"*{PARTIAL}"):
            if partial.name.removesuffix(PARTIAL) in keep or partial.is_symlink():
                continue
            try:
                with open(partial, "rb") as f:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    partial.unlink()
            except OSError:
                pass


class _Hasher(Protocol):
    """hashlib's sha256 and sha1, as a download uses them."""

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


def _hasher(f: HubFile) -> _Hasher:
    if f.hash_kind is HashKind.SHA256:
        return hashlib.sha256()
    h = hashlib.sha1()
    h.update(b"blob %d\0" % f.size)  # git's blob hash: a header, then the content
    return h


def download(
    client: HubClient,
    repo_id: str,
    commit: str,
    f: HubFile,
    cache: RepoCache,
    on_bytes: Callable[[int], None],
) -> int:
    """Bring one file into its blob (resuming a partial one); returns the bytes downloaded."""
    blob = cache.blob(f.blob_id)
    if blob.is_file() and blob.stat().st_size == f.size:
        return 0
    partial = inside(cache.root, blob.with_name(blob.name + PARTIAL))
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "r+b", buffering=0) as out:
        try:
            fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PullError(f"{repo_id}: another `moe pull` is writing {f.name}") from None
        have, hasher = _resume(out, f)
        on_bytes(have)
        fetched = _fetch(client, repo_id, commit, f, out, hasher, have, on_bytes)
        os.fsync(out.fileno())
        if hasher.hexdigest() != f.blob_id:
            partial.unlink(missing_ok=True)
            raise PullError(
                f"{repo_id}: {f.name} arrived damaged: its {f.hash_kind.value} is "
                f"{hasher.hexdigest()}, the Hub lists {f.blob_id} (removed; run the pull again)"
            )
        os.replace(partial, blob)
    return fetched


def _resume(out: FileIO, f: HubFile) -> tuple[int, _Hasher]:
    """The partial file's length and the hash of its bytes (a longer one starts over)."""
    have = os.fstat(out.fileno()).st_size
    hasher = _hasher(f)
    if have > f.size:
        out.truncate(0)
        return 0, hasher
    out.seek(0)
    left = have
    while left:
        chunk = out.read(min(left, 1 << 20))
        if not chunk:
            break
        hasher.update(chunk)
        left -= len(chunk)
    out.seek(have)
    return have, hasher


def _fetch(
    client: HubClient,
    repo_id: str,
    commit: str,
    f: HubFile,
    out: FileIO,
    hasher: _Hasher,
    have: int,
    on_bytes: Callable[[int], None],
) -> int:
    fetched, idle = 0, 0
    while have < f.size:
        before = have
        try:
            with client.stream(repo_id, commit, f.name, have) as (start, chunks):
                skip = have - start  # a server that ignored the Range resends what we have
                for chunk in chunks:
                    if skip:
                        dropped = min(skip, len(chunk))
                        chunk, skip = chunk[dropped:], skip - dropped
                    chunk = chunk[: f.size - have]  # cut at the size the listing announced
                    if chunk:
                        out.write(chunk)
                        hasher.update(chunk)
                        have += len(chunk)
                        fetched += len(chunk)
                        on_bytes(len(chunk))
                    if have >= f.size:
                        break
        except NETWORK_ERRORS as exc:
            if have == before and idle + 1 >= ATTEMPTS:
                raise network_error(f"{repo_id}: downloading {f.name}", exc) from None
        idle = 0 if have > before else idle + 1
        if idle >= ATTEMPTS:
            raise PullError(
                f"{repo_id}: {f.name} stopped at {have} of {f.size} bytes; run the pull again"
            )
    return fetched
