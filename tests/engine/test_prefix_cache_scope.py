"""Prefix-cache scopes in process: requests of one principal (and salt) resume from each other's
prefixes, in memory and from the SSD after a restart; another principal, another salt or the
default scope never does, so `cached_tokens` and time to first token tell nothing of another
principal's prompts. Tokens are the cache off's either way."""

from __future__ import annotations

from moed.daemon.engine.prefix_cache.scope import DEFAULT_SCOPE, cache_scope
from tests.engine.test_prefix_cache_disk import engine, finish
from tests.fixtures.engine_driver import SYSTEM, converse

PROMPT = SYSTEM + [4, 5, 6]


def test_the_scope_is_the_default_without_principal_and_salt_and_a_digest_otherwise():
    assert cache_scope(None, None) == DEFAULT_SCOPE
    scopes = {
        cache_scope("key:a", None),
        cache_scope(None, "key:a"),
        cache_scope("key:a", "s"),
        cache_scope("key:as", None),
        cache_scope("key:a", "s2"),
    }
    assert len(scopes) == 5 and all(len(s) == 32 and "key" not in s for s in scopes)


def test_principals_and_salts_never_share_a_cached_prefix(tiny_model, tmp_path):
    off = engine(tiny_model, tmp_path / "off", prefix="0", disk="0")
    ((want, _),) = converse(off, [PROMPT])
    off.close()
    disk = tmp_path / "cache"
    core = engine(tiny_model, tmp_path, disk_dir=disk)
    asked = [
        {"principal": "key:a"},
        {"principal": "key:a"},  # the same principal: a hit
        {"principal": "key:b"},  # the same prompt, another principal: none
        {},  # the default scope (the daemon's own clients): none
        {"principal": "key:a", "cache_salt": "salt-1"},  # a salt of its own: none
        {"principal": "key:a", "cache_salt": "salt-1"},  # ... until it is sent again
        {"principal": "key:a", "cache_salt": "salt-2"},
    ]
    got = [converse(core, [PROMPT], first_id=i, **fields)[0] for i, fields in enumerate(asked)]
    snap = finish(core)
    assert all(tokens == want for tokens, _ in got)
    cached = [c for _, c in got]
    assert cached[0] == cached[2] == cached[3] == cached[4] == cached[6] == 0, cached
    assert cached[1] >= len(SYSTEM) and cached[5] >= len(SYSTEM), cached
    assert snap["disk_entries"] >= 5  # one per scope, on the SSD too

    again = engine(tiny_model, tmp_path, disk_dir=disk)  # a restart: only the SSD tier
    after = [
        converse(again, [PROMPT], first_id=10 + i, **fields)[0]
        for i, fields in enumerate([{"principal": "key:c"}, {"principal": "key:b"}])
    ]
    snap = finish(again)
    assert all(tokens == want for tokens, _ in after)
    assert after[0][1] == 0 and after[1][1] >= len(SYSTEM), after
    assert snap["disk_loads"] == 1
