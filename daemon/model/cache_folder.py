"""The prefix cache's SSD folder: this user's own, and nobody else may write in it.

Its entries hold prompts' token ids and the KV the daemon serves from them. Another user who can
write the folder can plant an entry that is served as this user's cache; one who can replace the
folder (it is theirs) can do anything to it. So the folder is refused, as the socket's directory
is (protocol/paths.py): owned by another user, or writable by group or others. Folders the daemon
makes are mode 0700, the entries in them 0600 (model/cache_file.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

# Under the SSD tier's folder, each model other than the started one keeps its entries in a
# folder of its own here, named after the name clients use for it: kept across unloads and
# restarts, with its own budget, never another model's to evict.
MODELS_FOLDER = "models"


class UnsafeCacheFolder(PermissionError):
    """A prefix-cache folder others could write or replace: refused, never chmodded (an
    OSError: the SSD tier's users warn and serve without it as for any folder they cannot use)."""


def check_cache_folder(path: Path) -> None:
    """The folder (a symlink to one is followed: its owner and mode decide) must be a directory
    owned by this user that neither group nor others can write."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # made private when the SSD tier opens
    except OSError as exc:
        raise UnsafeCacheFolder(
            f"prefix-cache folder {path} cannot be read ({exc.strerror})"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheFolder(f"prefix-cache folder {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeCacheFolder(
            f"prefix-cache folder {path} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}): its entries would be another user's to change; choose "
            "another --prefix-cache-dir"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheFolder(
            f"prefix-cache folder {path} has mode {stat.S_IMODE(st.st_mode):04o}: others can "
            "write in it and plant entries; chmod go-w (or 700) it or choose another "
            "--prefix-cache-dir"
        )


def make_private_folder(path: Path) -> None:
    """Make `path` and every missing folder above it mode 0700 (mkdir's `parents` would make
    those with the umask's mode); then check it. OSError, UnsafeCacheFolder."""
    missing = []
    at = Path(path)
    while not at.exists() and at != at.parent:
        missing.append(at)
        at = at.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)  # the umask can only clear bits of 0700
        except FileExistsError:
            pass  # made meanwhile (another daemon on the same folder): checked below
    check_cache_folder(path)


def model_cache_folder(root: Path, name: str) -> Path:
    """The SSD prefix-cache folder of the model clients call `name`, under the tier's `root`:
    the name made safe for a file name, then a digest of it (two names never share one)."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:64] or "model"
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return Path(root) / MODELS_FOLDER / f"{readable}-{digest}"
