"""One gateway, several principals: with two keys in --api-key-file, a client of one key never
resumes from (and so never learns, through `cached_tokens` or the time to its first token) the
prompts another key's clients sent, and `cache_salt` (vLLM's field) separates requests of one key;
through the official openai package against a real daemon and gateway."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.fixtures.daemon_harness import start_daemon
from tests.fixtures.gateway_harness import start_gateway

pytestmark = pytest.mark.process

KEYS = ("tenant-a-" + "a" * 24, "tenant-b-" + "b" * 24)
SECRET = "The vault code is 493817. Keep it to yourself and answer briefly."


@pytest.fixture(scope="module")
def two_keys(tmp_path_factory, tiny_model):
    """A daemon with its prefix cache, and a gateway whose key file holds two keys."""
    tmp = tmp_path_factory.mktemp("scope")
    key_file = tmp / "keys"
    key_file.write_text(f"# one key a line, each a principal\n{KEYS[0]}\n\n{KEYS[1]}\n")
    key_file.chmod(0o600)
    daemon = start_daemon(tmp / "d", tiny_model, "--resident", "--prefix-cache-disk", "0")
    gateway = None
    try:
        gateway = start_gateway(tmp / "g", daemon.socket, "--api-key-file", str(key_file))
        yield gateway
    finally:
        if gateway is not None:
            gateway.stop()
        daemon.stop()


def cached(gateway, key: str, **extra) -> tuple[str, int]:
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
    chat = oai.chat.completions.create(
        model="qwen3_moe",
        messages=[{"role": "system", "content": SECRET}, {"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        **extra,
    )
    return chat.choices[0].message.content, chat.usage.prompt_tokens_details.cached_tokens


def test_two_keys_never_share_a_cached_prefix_and_a_salt_separates(two_keys):
    text, first = cached(two_keys, KEYS[0])
    again = cached(two_keys, KEYS[0])
    other = cached(two_keys, KEYS[1])  # the same prompt, the other key
    assert first == 0 and again[1] > 0 and again[0] == text
    assert other == (text, 0), other
    assert cached(two_keys, KEYS[1])[1] > 0  # its own prefix from now on
    salted = [cached(two_keys, KEYS[0], extra_body={"cache_salt": "s-1"}) for _ in range(2)]
    assert salted[0] == (text, 0) and salted[1][1] > 0, salted
    assert cached(two_keys, KEYS[0], extra_body={"cache_salt": "s-2"}) == (text, 0)


def test_a_cache_salt_must_be_a_non_empty_string(two_keys):
    for salt in ("", 7):
        answer = httpx.post(
            f"{two_keys.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEYS[0]}"},
            json={"messages": [{"role": "user", "content": "Hi"}], "cache_salt": salt},
            timeout=30,
        )
        assert answer.status_code == 400 and "cache_salt" in answer.text, answer.text
    wrong = {"Authorization": "Bearer not-a-key-of-this-gateway"}
    refused = httpx.get(f"{two_keys.url}/v1/models", headers=wrong)
    assert refused.status_code == 401
