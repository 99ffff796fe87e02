"""The demo corpus: the Python standard library's own source, which every machine has offline.

Files are split into train and validation by a hash of their relative path, so the split is
stable across runs and a file never straddles both sides.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EOS = "<|endoftext|>"

# Vendored third-party code and the (huge, repetitive) test suites would dominate a small corpus.
_SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    root: Path
    train_files: tuple[Path, ...]
    val_files: tuple[Path, ...]

    def train_text(self) -> str:
        return _join(self.train_files)

    def val_text(self) -> str:
        return _join(self.val_files)

    def describe(self) -> str:
        def mb(files):
            return sum(f.stat().st_size for f in files) / 1e6

        return (
            f"stdlib {self.root}: {len(self.train_files)} train files "
            f"({mb(self.train_files):.2f} MB), "
            f"{len(self.val_files)} validation files ({mb(self.val_files):.2f} MB)"
        )


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _key(rel: str) -> str:
    return hashlib.sha256(rel.encode()).hexdigest()


def stdlib_files(root: Path) -> list[Path]:
    files = [
        f
        for f in root.rglob("*.py")
        if not (_SKIP_PARTS & set(f.relative_to(root).parts)) and f.is_file()
    ]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def build_corpus(
    max_train_bytes: int = 6_000_000,
    max_val_bytes: int = 400_000,
    val_every: int = 20,
    max_file_bytes: int = 200_000,
) -> Corpus:
    """Pick files in a fixed pseudo-random order (hash of the path) until each side is full.

    Sorting by hash rather than by name keeps the capped corpus a mix of all packages instead of
    the alphabetically first ones. Files larger than `max_file_bytes` are skipped (a few generated
    tables would otherwise take a large share of the budget).
    """
    root = stdlib_root()
    files = stdlib_files(root)
    order = sorted(files, key=lambda f: _key(f.relative_to(root).as_posix()))
    train, val = [], []
    train_bytes = val_bytes = 0
    for f in order:
        size = f.stat().st_size
        if size == 0 or size > max_file_bytes:
            continue
        is_val = int(_key(f.relative_to(root).as_posix())[:8], 16) % val_every == 0
        if is_val and val_bytes + size <= max_val_bytes:
            val.append(f)
            val_bytes += size
        elif not is_val and train_bytes + size <= max_train_bytes:
            train.append(f)
            train_bytes += size
    return Corpus(root, tuple(train), tuple(val))


def _join(files) -> str:
    # Each file ends with EOS so the model learns where a module stops.
    parts = []
    for f in files:
        parts.append(f.read_text(encoding="utf-8", errors="replace"))
        parts.append(EOS)
    return "".join(parts)
