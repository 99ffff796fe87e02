"""The checkpoint's text files (config, tokenizer, generation settings) read once before loading:
one that is not UTF-8, not JSON, not a JSON object or absurdly large is named in a one-line exit,
not a UnicodeDecodeError from deep inside the load."""

from __future__ import annotations

import json
from pathlib import Path

# The JSON files mlx-lm and transformers read at load (tokenizer.json is the large one).
TEXT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
)
# A config is kilobytes and a tokenizer tens of megabytes; past this it is not one.
MAX_TEXT_BYTES = {"tokenizer.json": 512 * 1024 * 1024}
DEFAULT_MAX_TEXT_BYTES = 16 * 1024 * 1024


class UnreadableCheckpoint(ValueError):
    """A checkpoint file that cannot be read; the message names it and why."""


def check_text_files(folder: Path) -> None:
    for name in TEXT_FILES:
        path = folder / name
        if not path.is_file():
            continue  # required ones are checked by the caller; optional ones may be absent
        limit = MAX_TEXT_BYTES.get(name, DEFAULT_MAX_TEXT_BYTES)
        try:
            size = path.stat().st_size
            if size > limit:
                raise UnreadableCheckpoint(f"{path}: {size} bytes, more than {limit} for {name}")
            value = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise UnreadableCheckpoint(
                f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at {exc.start})"
            ) from None
        except json.JSONDecodeError as exc:
            raise UnreadableCheckpoint(f"{path}: not valid JSON ({exc})") from None
        except RecursionError:
            raise UnreadableCheckpoint(f"{path}: JSON nested too deep") from None
        except OSError as exc:
            raise UnreadableCheckpoint(f"{path}: cannot be read ({exc.strerror})") from None
        if not isinstance(value, dict):
            raise UnreadableCheckpoint(f"{path}: not a JSON object")
