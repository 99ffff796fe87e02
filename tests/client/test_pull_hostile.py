"""`moe pull` against a Hub that lies (a real HTTP server standing in for it), a pull killed with
SIGKILL, no network at all, and a cache that `moe list` must read without trusting: every case
ends in success with nothing written outside the cache, or in one clear line and exit 6."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moed.client.exit_codes import ExitCode
from tests.fixtures.fake_hub import FakeHub
from tests.fixtures.hub_cli import REPO, json_lines, moe

pytestmark = pytest.mark.process


@pytest.fixture
def hub(tiny_model):
    hub = FakeHub()
    hub.add_folder(REPO, tiny_model)
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture
def hf_env(hub, tmp_path):
    # The cache sits two levels down, so that `../../x` from its blobs lands in tmp_path.
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "home" / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "NO_PROXY": "127.0.0.1",
    }


def cache_dir(env: dict) -> Path:
    return Path(env["HF_HOME"]) / "hub"


def outside_cache(tmp_path: Path, env: dict) -> list[Path]:
    """Every file under tmp_path that is not inside the cache."""
    cache = cache_dir(env)
    return [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(cache)]


def one_line_failure(out: subprocess.CompletedProcess, *words: str) -> str:
    assert out.returncode == ExitCode.MODEL_UNAVAILABLE, (out.returncode, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def snapshot_matches(pulled: dict, tiny_model: Path) -> None:
    snapshot = Path(pulled["path"])
    for source in tiny_model.iterdir():
        assert (snapshot / source.name).read_bytes() == source.read_bytes(), source.name


def test_a_hostile_etag_and_commit_header_write_nothing_outside_the_cache(
    hub, hf_env, tmp_path, tiny_model
):
    for name in hub.repos[REPO].files:
        hub.headers[name] = {"ETag": '"../../../../x"', "X-Repo-Commit": "../../../../evil"}
    out = moe("pull", REPO, "--json", env=hf_env)
    assert out.returncode == 0, out.stderr
    snapshot_matches(json_lines(out.stdout)[-1], tiny_model)
    assert outside_cache(tmp_path, hf_env) == []
    assert not (tmp_path / "x").exists() and not (tmp_path / "evil").exists()


def test_a_forged_commit_on_a_404_writes_nothing_outside_the_cache(hub, hf_env, tmp_path):
    hub.missing.add("config.json")
    hub.headers["config.json"] = {"X-Repo-Commit": "../../../../evil"}
    out = moe("pull", REPO, env=hf_env)
    one_line_failure(out, "config.json", "404")
    assert outside_cache(tmp_path, hf_env) == []
    assert not any(p.name == "evil" for p in tmp_path.rglob("*"))


def test_a_file_served_past_its_listed_size_is_cut_there_and_verified(hub, hf_env, tiny_model):
    shard = max(tiny_model.glob("model*.safetensors"), key=lambda p: p.stat().st_size)
    hub.overflow[shard.name] = 256 * 1024 * 1024  # no Content-Length: only the listing says
    out = moe("pull", REPO, "--json", env=hf_env)
    assert out.returncode == 0, out.stderr
    pulled = json_lines(out.stdout)[-1]
    snapshot_matches(pulled, tiny_model)
    blobs = list((cache_dir(hf_env) / "models--tiny-org--tiny-moe" / "blobs").iterdir())
    assert sum(b.stat().st_size for b in blobs) == pulled["size_bytes"]


def test_a_different_file_under_a_listed_name_is_refused_and_removed(hub, hf_env, tiny_model):
    # The listing names one content (its sha256), the server sends other bytes of that size.
    shard = max(tiny_model.glob("model*.safetensors"), key=lambda p: p.stat().st_size)

    def other_hash(_repo, info):
        for s in info["siblings"]:
            if s["rfilename"] == shard.name:
                s["lfs"]["sha256"] = "ab" * 32
        return info

    hub.edit_listing = other_hash
    one_line_failure(moe("pull", REPO, env=hf_env), shard.name, "arrived damaged")
    blobs = cache_dir(hf_env) / "models--tiny-org--tiny-moe" / "blobs"
    assert not any(p.name.startswith("ab" * 32) for p in blobs.iterdir())
    hub.edit_listing = None
    assert moe("pull", REPO, env=hf_env).returncode == 0


def test_a_pull_killed_mid_file_resumes_from_its_partial_file(hub, hf_env, tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    folder = tmp_path / "big"
    folder.mkdir()
    save_file({"w": np.arange(2_000_000, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    hub.add_folder("tiny-org/big", folder)
    cut = 3_000_000
    hub.stall_after["model.safetensors"] = cut
    proc = subprocess.Popen(
        [sys.executable, "-m", "moed.client.cli", "pull", "tiny-org/big"],
        env={**os.environ, **hf_env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    blobs = cache_dir(hf_env) / "models--tiny-org--big" / "blobs"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        partial = list(blobs.glob("*.incomplete")) if blobs.is_dir() else []
        if partial and partial[0].stat().st_size == cut:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(list(blobs.glob("*.incomplete"))) == 1, "the partial file outlives the kill"
    hub.release.set()
    out = moe("pull", "tiny-org/big", "--json", env=hf_env)
    assert out.returncode == 0, out.stderr
    gets = hub.gets("big/resolve/" + hub.repos["tiny-org/big"].sha + "/model.safetensors")
    assert [g.range for g in gets] == [None, f"bytes={cut}-"]
    pulled = json_lines(out.stdout)[-1]
    shard_bytes = (folder / "model.safetensors").stat().st_size
    assert pulled["downloaded_bytes"] == shard_bytes - cut  # the rest of the shard, no more
    got = (Path(pulled["path"]) / "model.safetensors").read_bytes()
    assert got == (folder / "model.safetensors").read_bytes()
    assert list(blobs.glob("*.incomplete")) == []


def test_a_stale_partial_file_of_a_blob_no_longer_listed_is_removed(hub, hf_env):
    blobs = cache_dir(hf_env) / "models--tiny-org--tiny-moe" / "blobs"
    blobs.mkdir(parents=True)
    stale = blobs / ("0" * 64 + ".incomplete")
    stale.write_bytes(b"\0" * 1000)
    assert moe("pull", REPO, env=hf_env).returncode == 0
    assert not stale.exists()


@pytest.mark.parametrize(
    "name",
    ["../../../../escape.json", "/tmp/absolute.json", "sub/../../up.json", "back\\slash.json"],
)
def test_unsafe_file_names_in_the_listing_are_refused(hub, hf_env, tmp_path, name):
    def add(_repo, info):
        info["siblings"].append({"rfilename": name, "size": 2, "blobId": "a" * 40})
        return info

    hub.edit_listing = add
    one_line_failure(moe("pull", REPO, env=hf_env), "unsafe file name")
    assert outside_cache(tmp_path, hf_env) == []
    assert not any((cache_dir(hf_env) / "models--tiny-org--tiny-moe").rglob("*.safetensors"))


@pytest.mark.parametrize(
    "repo_id", ["a/../b", "../x", "org/na me", "a/b/c", "org/", "org--x/y", "org/name."]
)
def test_bad_repo_ids_are_one_line_and_exit_6(hf_env, repo_id):
    one_line_failure(moe("pull", repo_id, env=hf_env), "not a Hugging Face id")


def test_a_huge_config_in_the_listing_is_refused_before_download(hub, hf_env):
    def huge(_repo, info):
        for s in info["siblings"]:
            if s["rfilename"] == "config.json":
                s["size"] = 1 << 30
        return info

    hub.edit_listing = huge
    one_line_failure(moe("pull", REPO, env=hf_env), "config.json", "limit")
    assert hub.gets("/config.json") == []


def _header(text: bytes) -> bytes:
    return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize(
    "header",
    [
        b"\xff" * 8,  # a header length beyond the file
        (5).to_bytes(8, "little") + b"[1,2]",  # JSON, but not an object
        (9).to_bytes(8, "little") + b"\xff\xfe{not js",  # not UTF-8, not JSON
        _header(b'{"w":{"dtype":"F32","shape":[1],"data_offsets":["a",4]}}'),
        _header(b'{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}'),
        _header(b'{"w":[1,2]}'),
    ],
    ids=["length", "list", "bytes", "offsets", "negative", "entry"],
)
def test_damaged_safetensors_headers_are_one_line(hub, hf_env, tiny_model, header):
    shard = max(tiny_model.glob("model*.safetensors"), key=lambda p: p.stat().st_size)
    hub.corrupt[shard.name] = header + b"\0" * 64
    one_line_failure(moe("pull", REPO, env=hf_env), shard.name)


def test_a_config_that_is_not_a_json_object_is_one_line(hub, hf_env):
    hub.corrupt["config.json"] = b"\xff\xfe not json"
    one_line_failure(moe("pull", REPO, env=hf_env), "config.json", "not JSON")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: connections are refused


def test_offline_an_endpoint_that_refuses_connections_is_one_line(hf_env):
    env = {**hf_env, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    one_line_failure(moe("pull", REPO, env=env), "cannot connect", "HF_ENDPOINT")
    assert json_lines(moe("pull", REPO, "--json", env=env).stdout)[-1]["code"] == "pull_failed"


def test_offline_with_no_network_at_all_is_one_line(hf_env):
    """The real thing: a network namespace with no interface up, the default endpoint."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a namespace without network")
    env = {k: v for k, v in hf_env.items() if k != "HF_ENDPOINT"}
    out = subprocess.run(
        ["unshare", "--net", sys.executable, "-m", "moed.client.cli", "pull", REPO],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    one_line_failure(out, REPO, "HF_ENDPOINT")


def test_list_never_loads_a_huge_config(hf_env):
    """A 1 GiB config.json in the cache (sparse: no disk used) is named, not read."""
    snapshot = cache_dir(hf_env) / "models--evil--huge" / "snapshots" / ("e" * 40)
    snapshot.mkdir(parents=True)
    with open(snapshot / "config.json", "wb") as f:
        f.truncate(1 << 30)
    (snapshot / "model.safetensors").write_bytes(b"\0" * 16)
    refs = snapshot.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text("e" * 40)
    # The probe's own peak: VmHWM, not ru_maxrss. Linux carries ru_maxrss across exec, and
    # subprocess starts the probe by vfork from this pytest process, so ru_maxrss would report
    # the whole suite's peak (hundreds of MB once mlx and the API clients are in) as the probe's.
    probe = (
        "import resource, sys\n"
        "from click.testing import CliRunner\n"
        "from moed.client.cli import main\n"
        "out = CliRunner().invoke(main, ['list', '--all', '--json'])\n"
        "sys.stdout.write(out.output)\n"
        "try:\n"
        "    status = open('/proc/self/status').read()\n"
        "    print(int(status.split('VmHWM:')[1].split()[0]) * 1024)\n"
        "except OSError:  # macOS: ru_maxrss in bytes, and the probe's own\n"
        "    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
        env={**os.environ, **hf_env},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    *lines, peak = out.stdout.splitlines()
    demo, model = json_lines("\n".join(lines))  # the demo is listed first, always
    assert demo["name"] == "demo" and model["name"] == "evil/huge"
    assert not model["servable"] and "limit" in model["why_not"]
    assert int(peak) < (1 << 30) // 4, "the process never held a fraction of the file"
