"""`moe pull / list / rm` against a local fake Hub (a real HTTP server, no network), and a daemon
serving what was pulled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moed.client.exit_codes import ExitCode
from tests.fixtures.hub_cli import REPO, json_lines, moe

pytestmark = pytest.mark.process


def test_pull_fetches_only_what_mlx_lm_needs_with_progress_and_verifies(hub, hf_env, tiny_model):
    out = moe("pull", REPO, "--json", env=hf_env)
    assert out.returncode == 0, out.stderr
    events = json_lines(out.stdout)
    progress = [e for e in events if e["type"] == "progress"]
    pulled = events[-1]
    assert pulled["type"] == "pulled" and pulled["verified_shards"] >= 1
    need = {p.name for p in tiny_model.iterdir()}
    assert pulled["size_bytes"] == sum(p.stat().st_size for p in tiny_model.iterdir())
    assert pulled["downloaded_bytes"] == pulled["size_bytes"]
    # Progress: bytes, never backwards, ending at the total.
    done = [e["done"] for e in progress]
    assert done == sorted(done) and progress[-1]["done"] == progress[-1]["total"]
    assert progress[-1]["unit"] == "bytes" and progress[-1].get("final")
    files = [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    fetched = {r.path.rsplit("/", 1)[-1] for r in files}
    assert fetched <= need, "only mlx-lm's files are downloaded"
    assert "README.md" not in fetched and "pytorch_model.bin" not in fetched
    snapshot = Path(pulled["path"])
    for name in need:
        assert (snapshot / name).read_bytes() == (tiny_model / name).read_bytes()

    # A second pull finds everything in the cache: no file is fetched again.
    before = len([r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path])
    again = moe("pull", REPO, env=hf_env)
    assert again.returncode == 0, again.stderr
    assert "already in the cache" in again.stdout
    after = len([r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path])
    assert after == before

    listed = json_lines(moe("list", "--json", env=hf_env).stdout)
    # The demo that ships inside moed comes first, as `--model demo` (the default) names it.
    assert [m["name"] for m in listed] == ["demo", REPO]
    assert listed[0]["builtin"] and listed[0]["servable"] and not listed[1]["builtin"]
    m = listed[1]
    assert m["servable"] and m["moe"] and m["num_experts"] == 8 and m["experts_per_token"] == 2
    table = moe("list", env=hf_env).stdout
    assert REPO in table and "8 x top-2" in table and "qwen3_moe" in table
    assert table.splitlines()[1].startswith("demo ") and "built in" in table

    gone = moe("rm", REPO, env=hf_env)
    assert gone.returncode == 0, gone.stderr
    assert [m["name"] for m in json_lines(moe("list", "--json", env=hf_env).stdout)] == ["demo"]
    assert moe("rm", REPO, env=hf_env).returncode == ExitCode.MODEL_UNAVAILABLE


def test_pull_resumes_a_dropped_connection_with_a_range_request(hub, hf_env, tmp_path):
    """A shard larger than huggingface_hub's 10 MiB write chunk, cut at 12 MB: the second GET asks
    for the rest only."""
    import numpy as np
    from safetensors.numpy import save_file

    folder = tmp_path / "big"
    folder.mkdir()
    save_file({"w": np.zeros((21, 250_000), dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    hub.add_folder("tiny-org/big-shard", folder)
    shard = folder / "model.safetensors"
    hub.drop_after[shard.name] = 12_000_000
    out = moe("pull", "tiny-org/big-shard", "--json", env=hf_env)
    assert out.returncode == 0, out.stderr
    # By commit: the revision is pinned at the listing's sha, as huggingface_hub's snapshot does.
    sha = hub.repos["tiny-org/big-shard"].sha
    gets = hub.gets(f"big-shard/resolve/{sha}/model.safetensors")
    assert len(gets) == 2 and gets[0].range is None
    resumed_at = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= 12_000_000
    pulled = json_lines(out.stdout)[-1]
    assert (Path(pulled["path"]) / shard.name).read_bytes() == shard.read_bytes()


def test_a_damaged_shard_is_refused_named_and_fetched_again_next_time(hub, hf_env, tiny_model):
    shard = max(tiny_model.glob("model*.safetensors"), key=lambda p: p.stat().st_size)
    hub.corrupt[shard.name] = shard.read_bytes()[: shard.stat().st_size // 2]  # truncated
    out = moe("pull", REPO, "--json", env=hf_env)
    assert out.returncode == ExitCode.MODEL_UNAVAILABLE
    error = json_lines(out.stdout)[-1]
    assert error["type"] == "error" and shard.name in error["message"]
    assert "truncated" in error["message"] or "does not fit" in error["message"]
    del hub.corrupt[shard.name]
    again = moe("pull", REPO, "--json", env=hf_env)
    assert again.returncode == 0, again.stderr
    assert len(hub.gets(shard.name)) == 2


def test_pull_of_an_unknown_repo_is_a_typed_error(hub, hf_env):
    out = moe("pull", "nobody/nothing", "--json", env=hf_env)
    assert out.returncode == ExitCode.MODEL_UNAVAILABLE
    assert "not on the Hub" in json_lines(out.stdout)[-1]["message"]
    hub.gated.add(REPO)
    out = moe("pull", REPO, "--json", env=hf_env)
    assert out.returncode == ExitCode.MODEL_UNAVAILABLE
    assert "gated" in json_lines(out.stdout)[-1]["message"] and "HF_TOKEN" in out.stderr


def test_the_daemon_serves_a_pulled_model_by_its_id(hub, hf_env, daemon_factory, tiny_model):
    assert moe("pull", REPO, env=hf_env).returncode == 0
    offline = {**hf_env, "HF_HUB_OFFLINE": "1"}  # the daemon never downloads
    d = daemon_factory(REPO, "--resident", env=offline)
    out = moe(
        "--socket", str(d.socket), "run", "--raw", "--no-start", "--json", "--max-tokens", "3",
        "--model", REPO, "def f", env=offline,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json_lines(out.stdout)[-1]["usage"]["completion_tokens"] == 3
    ps = json_lines(moe("--socket", str(d.socket), "ps", "--json", env=offline).stdout)[0]
    assert ps["state"] == "ready" and ps["path"].endswith("/snapshots/" + hub.repos[REPO].sha)
    # A model that is not servable here: a typed refusal, not a silent swap.
    other = moe(
        "--socket", str(d.socket), "run", "--raw", "--no-start", "--json", "--model", "nobody/x",
        "x", env=offline,
    )  # fmt: skip
    assert other.returncode == ExitCode.REQUEST_FAILED
    assert json_lines(other.stdout)[-1]["code"] == "model_not_found"
    # The served model cannot be removed from under the daemon by accident.
    assert moe("--socket", str(d.socket), "rm", REPO, env=offline).returncode == ExitCode.USAGE


def test_pull_list_and_rm_never_import_mlx(hub, hf_env):
    """client/ stays mlx-free: the model commands run in a process that never loads mlx."""
    probe = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from moed.client.cli import main\n"
        f"for args in (['pull', {REPO!r}], ['list', '--all'], ['rm', {REPO!r}]):\n"
        "    assert CliRunner().invoke(main, args).exit_code == 0, args\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **hf_env},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
