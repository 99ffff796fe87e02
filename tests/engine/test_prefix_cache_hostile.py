"""The SSD tier against files it did not write, or that were changed after it wrote them, in
process: a malformed header, an entry claiming more than its file holds, a symlink (to an entry
or to a secret), a flipped bit in a header's token ids and token ids swapped between two entries
are each skipped and counted, nothing of a file's content reaches the log, and every answer is
the answer of the cache off. Entry files are 0600, the folders the daemon makes 0700, and a folder
others can write is no SSD tier."""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import stat
import struct

import numpy as np
import pytest

from moed.daemon.engine.prefix_cache.disk_tier import DiskTier
from moed.daemon.model.entry_file import EntryProblem, EntryRejected, open_entry
from moed.daemon.telemetry.metrics import render_metrics
from tests.engine.test_prefix_cache_disk import _entry, _entry_files, engine, finish, warnings_of
from tests.fixtures.engine_driver import SYSTEM, TURNS, converse

# Its first 8 bytes, read as a header's length, once reached the log as a number.
SECRET = b"hunter2-password-of-another-user\n"


def read_entry(path) -> tuple[dict, bytes]:
    """A safetensors file's header (JSON) and its data section."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_entry(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    path.chmod(0o600)


def tokens_of(header: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(header["__metadata__"]["0.tokens"]), dtype="<i4")


def with_tokens(header: dict, tokens) -> dict:
    meta = dict(header["__metadata__"])
    meta["0.tokens"] = base64.b64encode(np.asarray(tokens, dtype="<i4").tobytes()).decode()
    return {**header, "__metadata__": meta}


@pytest.fixture
def expected(tiny_model, tmp_path):
    """The tokens of the cache off for the turns, and for two more prompts the tests send."""
    off = engine(tiny_model, tmp_path / "off", prefix="0", disk="0")
    out = converse(off, TURNS + [SYSTEM + [7, 8, 9]])
    off.close()
    return out


@pytest.fixture
def written(tiny_model, tmp_path):
    """A folder of entries a first engine wrote for TURNS[:2] (the model's own, valid)."""
    disk = tmp_path / "cache"
    first = engine(tiny_model, tmp_path / "first", disk_dir=disk)
    converse(first, TURNS[:2])
    assert finish(first)["disk_entries"] >= 1
    return disk


def rejected(snap: dict) -> dict:
    return snap.get("disk_rejected", {})


def test_a_malformed_header_is_skipped_and_counted_and_the_rest_of_the_cache_serves(
    tiny_model, tmp_path, written, expected, caplog
):
    # A copy of a valid entry under another name, its checkpoints a number instead of a list:
    # once it turned the whole prefix cache off (a TypeError at every start).
    header, data = read_entry(_entry_files(written)[0])
    meta = dict(header["__metadata__"], **{"0.checkpoints": "5", "0.key": "ab" * 16})
    write_entry(written / ("ab" * 16 + ".safetensors"), {**header, "__metadata__": meta}, data)
    caplog.set_level(logging.WARNING, logger="moed.prefix_cache")
    core = engine(tiny_model, tmp_path, disk_dir=written)
    assert core.prefix.cache is not None and core.prefix.cache.disk is not None
    got = converse(core, TURNS[2:], first_id=2)
    snap = finish(core)
    assert [t for t, _ in got] == [t for t, _ in expected[2:4]]
    assert got[0][1] >= len(SYSTEM), got  # the valid entries still serve
    assert snap["disk_skipped"] == 1 and sum(rejected(snap).values()) == 1, snap
    assert not any("Traceback" in w for w in warnings_of(caplog))


def test_an_entry_claiming_more_than_its_file_holds_is_refused_before_reading(
    tiny_model, tmp_path, written, expected
):
    # The first valid entry's metadata (its tokens are the turns' prefix), one tensor claiming
    # 512 MiB, in a file of a few hundred bytes: refused from its header, never listed or read.
    name = _entry_files(written)[0]
    header, _ = read_entry(name)
    claimed = 512 << 20
    huge = {"dtype": "F32", "shape": [claimed // 4], "data_offsets": [0, claimed]}
    write_entry(name, {"__metadata__": header["__metadata__"], "0.0": huge}, b"\0" * 64)
    with pytest.raises(EntryRejected) as refused, open_entry(name, max_bytes=1 << 40):
        pass
    assert refused.value.problem is EntryProblem.MALFORMED
    core = engine(tiny_model, tmp_path, disk_dir=written)
    listed = {r.key for r in core.prefix.cache.disk.records()}
    got = converse(core, TURNS[2:3], first_id=2)
    snap = finish(core)
    assert name.stem not in listed
    assert rejected(snap).get(EntryProblem.MALFORMED.value) == 1, snap
    assert got[0][0] == expected[2][0]


def test_an_entry_larger_than_the_budget_is_refused_unread(tmp_path):
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.truncate(64 << 20)  # sparse: no disk, no memory
    path.chmod(0o600)
    with pytest.raises(EntryRejected) as refused, open_entry(path, max_bytes=1 << 20):
        pass
    assert refused.value.problem is EntryProblem.TOO_LARGE


def test_symlinks_are_never_followed_and_nothing_of_a_linked_file_is_logged(
    tiny_model, tmp_path, written, expected, caplog
):
    # The valid entries moved outside the folder and linked back in: they were served.
    outside = tmp_path / "outside"
    outside.mkdir()
    for path in _entry_files(written):
        moved = outside / path.name
        shutil.move(path, moved)
        path.symlink_to(moved)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    (written / ("cd" * 16 + ".safetensors")).symlink_to(secret)
    links = _entry_files(written)
    caplog.set_level(logging.DEBUG, logger="moed")
    core = engine(tiny_model, tmp_path, disk_dir=written)
    got = converse(core, TURNS[2:3], first_id=2)
    snap = finish(core)
    assert got[0] == (expected[2][0], 0)  # nothing from outside the folder is served
    assert rejected(snap).get(EntryProblem.NOT_REGULAR.value) == len(links), snap
    assert secret.read_bytes() == SECRET and all(p.is_symlink() for p in links)  # left alone
    logged = caplog.text
    assert "hunter2" not in logged and str(struct.unpack("<Q", SECRET[:8])[0]) not in logged


def test_a_flipped_bit_in_a_headers_token_ids_is_rejected(tiny_model, tmp_path, written, expected):
    # Entry tokens T; one bit of T[k] flipped makes it claim the prompt that differs there.
    # Once served: KV computed for T answered that prompt.
    path = max(_entry_files(written), key=lambda p: len(tokens_of(read_entry(p)[0])))
    header, data = read_entry(path)
    tokens = tokens_of(header).copy()
    k = len(SYSTEM) - 5
    tokens[k] ^= 1
    write_entry(path, with_tokens(header, tokens), data)
    prompt = [int(t) for t in tokens[: len(SYSTEM)]] + [7, 8, 9]
    off = engine(tiny_model, tmp_path / "off2", prefix="0", disk="0")
    want = converse(off, [prompt], first_id=9)
    off.close()
    core = engine(tiny_model, tmp_path, disk_dir=written)
    got = converse(core, [prompt], first_id=9)
    snap = finish(core)
    assert got[0][0] == want[0][0]
    assert got[0][1] <= k  # nothing of the flipped entry beyond the flip
    assert rejected(snap).get(EntryProblem.MISMATCH.value) == 1, snap


def test_token_ids_swapped_between_two_entries_are_rejected(tiny_model, tmp_path, expected):
    # Two prompts of one length: their entries have the same shapes; their token ids swapped,
    # each file claims the other's prompt with its own KV.
    disk = tmp_path / "cache"
    a, b = SYSTEM + [7, 8, 9], [(5 * i) % 200 + 3 for i in range(len(SYSTEM))] + [7, 8, 9]
    first = engine(tiny_model, tmp_path / "first", disk_dir=disk)
    converse(first, [a, b])
    finish(first)
    by_length: dict[int, list] = {}
    for path in _entry_files(disk):
        by_length.setdefault(len(tokens_of(read_entry(path)[0])), []).append(path)
    (pa, pb) = next(paths for paths in by_length.values() if len(paths) == 2)
    (ha, da), (hb, db) = read_entry(pa), read_entry(pb)
    write_entry(pa, with_tokens(ha, tokens_of(hb)), da)
    write_entry(pb, with_tokens(hb, tokens_of(ha)), db)
    core = engine(tiny_model, tmp_path, disk_dir=disk)
    got = converse(core, [a], first_id=4)
    snap = finish(core)
    assert got[0] == (expected[4][0], 0)
    assert rejected(snap).get(EntryProblem.MISMATCH.value) == 2, snap


def test_entries_are_private_and_the_folders_made_for_them_too(tiny_model, tmp_path):
    disk = tmp_path / "made" / "for" / "it"
    core = engine(tiny_model, tmp_path, disk_dir=disk)
    converse(core, TURNS[:1])
    finish(core)
    files = _entry_files(disk)
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    for folder in (disk, disk.parent, disk.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_a_folder_others_can_write_is_no_ssd_tier(tmp_path, caplog):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    caplog.set_level(logging.WARNING, logger="moed.prefix_cache")
    tier = DiskTier(folder, 64 << 20, "f" * 32, (True,))
    tier.write(_entry(range(3, 20)))
    tier.close()
    assert not tier.usable and tier.writes == 0 and not list(folder.iterdir())
    assert any("0777" in w and "others can write" in w for w in warnings_of(caplog))


def test_an_older_moeds_entries_are_skipped_and_counted(tiny_model, tmp_path, written, expected):
    # The previous format: a CRC of the arrays only, no key, no scope, no digest.
    for path in _entry_files(written):
        header, data = read_entry(path)
        meta = {k: v for k, v in header["__metadata__"].items() if k[2:] not in {"key", "scope"}}
        meta.pop("0.digest")
        meta.update({"0.format": "moed-prefix-cache", "0.crc32": "00000000"})
        write_entry(path, {**header, "__metadata__": meta}, data)
    count = len(_entry_files(written))
    core = engine(tiny_model, tmp_path, disk_dir=written)
    got = converse(core, TURNS[2:3], first_id=2)
    snap = finish(core)
    assert got[0] == (expected[2][0], 0)
    assert snap["disk_skipped"] == count and snap["disk_entries"] >= 1  # this run's own


def test_an_unusable_entry_is_counted_per_reason_in_the_metrics(tmp_path):
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    os.mkfifo(folder / ("ef" * 16 + ".safetensors"))
    (folder / ("01" * 16 + ".safetensors")).write_bytes(b"not a safetensors file")
    tier = DiskTier(folder, 64 << 20, "f" * 32, (True,))
    snap = tier.snapshot()
    tier.close()
    assert snap["disk_rejected"] == {"malformed": 1, "not_regular": 1}
    text = render_metrics({"prefix_cache": snap})
    assert 'moed_prefix_cache_disk_rejected_total{reason="not_regular"} 1' in text


def test_a_device_a_directory_or_another_users_file_is_refused_unread(tmp_path):
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    (folder / ("0d" * 16 + ".safetensors")).mkdir()
    theirs = folder / ("0e" * 16 + ".safetensors")
    theirs.write_bytes(b"\0" * 64)
    expected = {"not_regular": 1}
    if os.geteuid() == 0:  # only root makes device nodes and gives files away
        os.mknod(folder / ("0c" * 16 + ".safetensors"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
        os.chown(theirs, 65534, 65534)
        expected = {"not_regular": 2, "not_ours": 1}
    else:
        expected["malformed"] = 1
    tier = DiskTier(folder, 64 << 20, "f" * 32, (True,))
    snap = tier.snapshot()
    tier.close()
    assert snap["disk_rejected"] == expected, snap
