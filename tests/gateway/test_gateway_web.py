"""The gateway as a local web service (issue 23): a browser page cannot reach it by DNS rebinding
or run a generation with a cross-origin `text/plain` POST, another local user is refused as the
daemon's socket refuses them, and every request leaves one access-log line without its prompt."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import stat
import subprocess

import httpx
import pytest

from moed.gateway import peer
from moed.gateway.config import gateway_key_path
from moed.gateway.peer import peer_uid
from tests.fixtures.daemon_harness import start_daemon
from tests.fixtures.gateway_harness import start_gateway


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model):
    d = start_daemon(tmp_path_factory.mktemp("web-gw"), tiny_model, "--resident")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def model_name(daemon) -> str:
    with daemon.client() as c:
        return c.connect()["model"]["name"]


@pytest.mark.process
def test_foreign_host_names_are_refused(daemon, model_name, tmp_path):
    """DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1 sends
    `Host: evil.example`; only loopback names and --allow-host ones are served."""
    gateway = start_gateway(tmp_path, daemon.socket, "--allow-host", "my.box")
    try:
        url = gateway.url
        for host in ("evil.example", "evil.example:11435", "127.0.0.1.evil.example", ""):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                reply = httpx.request(
                    method,
                    f"{url}{path}",
                    headers={"Host": host},
                    json={"model": model_name, "prompt": "x", "max_tokens": 1},
                )
                assert reply.status_code == 403, (host, path, reply.text)
                assert "Host" in reply.json()["error"]["message"]
        for host in ("localhost", f"localhost:{gateway.port}", "127.0.0.1:80", "[::1]:1", "my.box"):
            assert httpx.get(f"{url}/v1/models", headers={"Host": host}).status_code == 200, host
    finally:
        gateway.stop()


@pytest.mark.process
def test_a_cross_origin_post_runs_nothing(daemon, model_name, tmp_path):
    """A page's `text/plain` POST needs no preflight: it is refused before it runs, so the ollama
    `keep_alive: 0` it carries does not unload the model. An origin given with --cors-origin is
    served."""
    gateway = start_gateway(tmp_path, daemon.socket, "--cors-origin", "http://ui.example")
    try:
        url = gateway.url
        evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
        unload = f'{{"model": "{model_name}", "prompt": "x", "keep_alive": 0, "stream": false}}'
        for path, body in [
            ("/api/generate", unload),
            ("/v1/completions", f'{{"model": "{model_name}", "prompt": "x", "max_tokens": 1}}'),
            ("/v1/messages", '{"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}'),
        ]:
            reply = httpx.post(f"{url}{path}", content=body, headers=evil)
            assert reply.status_code == 403, (path, reply.text)
        with daemon.client() as c:
            assert c.status()["state"] == "ready"  # not unloaded
        # Reads stay readable by nobody but CORS decides; the allowed origin may post.
        assert httpx.get(f"{url}/v1/models", headers=evil).status_code == 200
        allowed = httpx.post(
            f"{url}/v1/completions",
            json={"model": model_name, "prompt": "x", "max_tokens": 1},
            headers={"Origin": "http://ui.example"},
        )
        assert allowed.status_code == 200, allowed.text
        assert allowed.headers["access-control-allow-origin"] == "http://ui.example"
    finally:
        gateway.stop()


# Run as the other user with the system interpreter (that user cannot read this venv).
HTTP_AS_OTHER = """
import http.client, sys
headers = {"Content-Type": "application/json"}
if len(sys.argv) > 3:
    headers["Authorization"] = sys.argv[3]
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=60)
conn.request("POST", "/v1/completions", body=sys.argv[2], headers=headers)
reply = conn.getresponse()
print(reply.status, reply.read().decode())
"""


def _post_as(user, port: int, body: str, auth: str | None = None) -> tuple[int, str]:
    out = subprocess.run(
        ["/usr/bin/python3", "-c", HTTP_AS_OTHER, str(port), body, *([auth] if auth else [])],
        capture_output=True,
        text=True,
        timeout=90,
        user=user.pw_uid,
        group=user.pw_gid,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    status, _, text = out.stdout.partition(" ")
    return int(status), text


@pytest.mark.process
def test_another_local_user_is_refused_by_uid(other_user, daemon, model_name, tmp_path):
    """The daemon's 0700 socket keeps other users out; the keyless loopback gateway does too (the
    peer's uid, looked up from the connection), while its own user is served."""
    gateway = start_gateway(tmp_path, daemon.socket, "--local-auth", "uid")
    try:
        body = f'{{"model": "{model_name}", "prompt": "secret", "max_tokens": 1}}'
        status, text = _post_as(other_user, gateway.port, body)
        assert status == 403 and f"uid {other_user.pw_uid}" in text, text
        mine = httpx.post(f"{gateway.url}/v1/completions", content=body)
        assert mine.status_code == 200, mine.text
    finally:
        gateway.stop()


@pytest.mark.process
def test_with_local_auth_off_each_local_user_is_a_principal_of_its_own(
    other_user, daemon, model_name, tmp_path
):
    """Another local user served (--local-auth off) never resumes from this user's cached
    prefixes, nor this user from theirs: `cached_tokens` tells nobody what another sent."""
    gateway = start_gateway(tmp_path, daemon.socket, "--local-auth", "off")
    prompt = "A note only its sender knows about: the door code is 4711. Repeat it."
    body = json.dumps({"model": model_name, "prompt": prompt, "max_tokens": 1})

    def cached(answer: dict) -> int:
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        theirs = []
        for _ in range(2):
            status, text = _post_as(other_user, gateway.port, body)
            assert status == 200, text
            theirs.append(json.loads(text))
        mine = httpx.post(f"{gateway.url}/v1/completions", content=body, timeout=60)
        assert mine.status_code == 200, mine.text
        assert cached(theirs[0]) == 0 and cached(theirs[1]) > 0, theirs
        assert cached(mine.json()) == 0
        assert mine.json()["choices"][0]["text"] == theirs[0]["choices"][0]["text"]
    finally:
        gateway.stop()


@pytest.mark.process
def test_key_mode_writes_a_private_key_that_other_users_cannot_use(
    other_user,
    daemon,
    model_name,
    tmp_path,
):
    """Where no socket table names the peer (macOS), the gateway writes a key (mode 0600, in the
    daemon's 0700 socket directory) and requires it."""
    gateway = start_gateway(tmp_path, daemon.socket, "--local-auth", "key")
    try:
        key_file = gateway_key_path(daemon.socket)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        body = f'{{"model": "{model_name}", "prompt": "x", "max_tokens": 1}}'
        assert httpx.post(f"{gateway.url}/v1/completions", content=body).status_code == 401
        served = httpx.post(
            f"{gateway.url}/v1/completions", content=body, headers={"x-api-key": key}
        )
        assert served.status_code == 200, served.text
        # The other user can neither read the key nor guess it.
        cat = subprocess.run(
            ["cat", str(key_file)], capture_output=True, user=other_user.pw_uid, cwd="/"
        )
        assert cat.returncode != 0 and not cat.stdout
        status, _ = _post_as(other_user, gateway.port, body, "Bearer guess")
        assert status == 401
    finally:
        gateway.stop()


@pytest.mark.process
def test_access_log_names_each_request_but_not_its_prompt(daemon, model_name, tmp_path):
    gateway = start_gateway(tmp_path / "loud", daemon.socket)
    quiet = start_gateway(tmp_path / "quiet", daemon.socket, "--quiet")
    try:
        prompt = "a-very-private-prompt"
        reply = httpx.post(
            f"{gateway.url}/v1/completions?user=me",
            json={"model": model_name, "prompt": prompt, "max_tokens": 1},
        )
        assert reply.status_code == 200
        request_id = reply.headers["x-request-id"]
        missing = httpx.get(f"{gateway.url}/no/such%0Apath")
        assert missing.status_code == 404
        gateway.stop()
        log = gateway.log()
        line = next(x for x in log.splitlines() if request_id in x)
        assert re.search(r'"POST /v1/completions HTTP/1\.1" 200 [\d.]+ms id=' + request_id, line)
        assert re.search(r'"GET /no/such\\npath HTTP/1\.1" 404 ', log), log
        assert prompt not in log and "user=me" not in log
        assert httpx.get(f"{quiet.url}/v1/models").status_code == 200
        quiet.stop()
        assert "moed.gateway.access" not in quiet.log()
    finally:
        gateway.stop()
        quiet.stop()


def _pair(family: int, host: str) -> tuple[socket.socket, socket.socket, socket.socket]:
    server = socket.socket(family)
    server.bind((host, 0))
    server.listen()
    client = socket.socket(family)
    client.connect(server.getsockname()[:2])
    accepted, _ = server.accept()
    return server, client, accepted


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_peer_uid_names_the_owner_of_a_real_loopback_connection(family, host):
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        server, client, accepted = _pair(family, host)
    except OSError:
        pytest.skip(f"cannot listen on {host}")
    try:
        # As the gateway sees it: the peer's address, then its own.
        there, here = accepted.getpeername()[:2], accepted.getsockname()[:2]
        assert peer_uid(there, here) == os.getuid()
        # A port nobody is connected from names nobody.
        assert peer_uid((host, 1), here) is None
        # Both ways of asking the kernel agree (sock_diag, and the /proc table it falls back to).
        ends = [(ipaddress.ip_address(h), p) for h, p in (there, here)]
        assert peer._diag_uid(*ends) == peer._proc_uid(*ends) == os.getuid()
    finally:
        for s in (client, accepted, server):
            s.close()
