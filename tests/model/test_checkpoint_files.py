"""A checkpoint whose config or tokenizer file cannot be read: `moed serve` exits 8 with one line
that names the file and why (issue 23), not a UnicodeDecodeError traceback from inside the load."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.fixtures.daemon_harness import serve_command, short_socket_path

pytestmark = pytest.mark.process

BROKEN = [
    ("config.json", b'{"model_type": "qwen3_moe", "name": "\xff\xfe"}', "not UTF-8"),
    ("tokenizer_config.json", b'{"unterminated": ', "not valid JSON"),
    ("tokenizer.json", b"[1, 2, 3]", "not a JSON object"),
]


@pytest.mark.parametrize("name,content,why", BROKEN, ids=[b[0] for b in BROKEN])
def test_an_unreadable_checkpoint_file_is_one_line(tiny_model, tmp_path, name, content, why):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / name).write_bytes(content)
    socket = short_socket_path()
    try:
        out = subprocess.run(
            serve_command(model, socket, tmp_path / "state", "--resident"),
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "MOED_LOG_DIR": str(tmp_path / "logs")},
        )
    finally:
        shutil.rmtree(socket.parent, ignore_errors=True)
    assert out.returncode == 8, out.stderr  # MODEL_UNUSABLE: fix the file, do not restart
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("moed:")]
    assert len(lines) == 1 and str(model / name) in lines[0] and why in lines[0], out.stderr
