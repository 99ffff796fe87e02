"""What `moe pull` accepts from the command line and from the Hub before any of it becomes a path.

A repo id, a revision, a file name, a commit and a blob id all end up as parts of paths in the
cache; each is checked here, and every path is checked to lie inside the cache once resolved
(a planted symlink in the cache counts), so that nothing a server says can write elsewhere.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

# The Hub's own rule (huggingface_hub.utils.validate_repo_id): letters, digits, `-_.`, at most 96
# characters per part, no `--` or `..` (the cache folder joins org and name with `--`).
_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_REVISION = re.compile(r"[A-Za-z0-9._/-]{1,255}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_BLOB_ID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a git blob sha1 or an LFS sha256
_FILE_PART = re.compile(r"[A-Za-z0-9._ +=,@()\[\]-]{1,255}")


class UnsafeName(ValueError):
    """A name that cannot safely become a path in the cache; the message says which and why."""


def check_repo_id(repo_id: str) -> str:
    parts = repo_id.split("/")
    if (
        len(parts) != 2
        or not all(_REPO_PART.fullmatch(p) for p in parts)
        or any(".." in p or "--" in p or p.endswith(".") for p in parts)
    ):
        raise UnsafeName(
            f"{repo_id!r} is not a Hugging Face id (org/name: letters, digits, '-', '_', '.'; "
            "no '..' or '--')"
        )
    return repo_id


def check_revision(revision: str) -> str:
    parts = revision.split("/")
    if not _REVISION.fullmatch(revision) or any(p in ("", ".", "..") for p in parts):
        raise UnsafeName(f"revision {revision!r} is not a branch, tag or commit name")
    return revision


def check_commit(commit: object, what: str = "commit") -> str:
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        raise UnsafeName(f"the Hub sent {what} {str(commit)[:80]!r}, not a 40-digit hex commit")
    return commit


def check_blob_id(blob_id: object, filename: str) -> str:
    if not isinstance(blob_id, str) or not _BLOB_ID.fullmatch(blob_id):
        raise UnsafeName(f"the Hub sent {str(blob_id)[:80]!r} as the hash of {filename}")
    return blob_id


def check_file_name(name: object) -> str:
    """A relative POSIX path of plain parts: no absolute path, `..`, backslash or control byte."""
    if not isinstance(name, str) or not name or len(name) > 1000:
        raise UnsafeName(f"the Hub listed a file named {str(name)[:80]!r}")
    parts = PurePosixPath(name).parts
    if (
        name.startswith("/")
        or "\\" in name
        or any(p in (".", "..") for p in name.split("/"))
        or not all(_FILE_PART.fullmatch(p) for p in parts)
    ):
        raise UnsafeName(f"the Hub listed an unsafe file name {name[:200]!r}")
    return name


def inside(root: Path, path: Path) -> Path:
    """`path` once every existing symlink is resolved, refused unless it lies inside `root`."""
    resolved = Path(os.path.realpath(path))
    if not resolved.is_relative_to(Path(os.path.realpath(root))):
        raise UnsafeName(f"{path} resolves to {resolved}, outside the cache {root}")
    return resolved
