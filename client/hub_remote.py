"""The Hub as `moe pull` speaks to it: one listing of a revision, then each file's bytes.

moed's own HTTP client (httpx, a dependency of moed), so that what a pull accepts and what it
raises do not change with huggingface_hub's transport (1.x: httpx, 2.x: httpx2). Every network
failure, offline included, becomes one PullError line. Nothing the server says in a header names
a path: the commit and each file's size and hash come from the listing, checked in hub_names.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from .hub_names import UnsafeName, check_blob_id, check_commit, check_file_name
from .hub_verify import PullError

DEFAULT_ENDPOINT = "https://huggingface.co"
MAX_LISTING_BYTES = 32 * 1024 * 1024  # a repo's file list; real ones are kilobytes
CHUNK_BYTES = 1024 * 1024
TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class HashKind(str, enum.Enum):
    SHA256 = "sha256"  # LFS files: the id is the sha256 of the content
    GIT_SHA1 = "git-sha1"  # files in git itself: the id is the git blob hash


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int
    blob_id: str  # the cache's blob name, and the hash the content must have
    hash_kind: HashKind


@dataclass(frozen=True)
class Listing:
    commit: str
    files: tuple[HubFile, ...]  # every file of the revision, names checked


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _headers() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from huggingface_hub import get_token

    try:
        headers = {"user-agent": f"moed/{version('moed')}"}
    except PackageNotFoundError:
        headers = {"user-agent": "moed"}
    if token := get_token():
        headers["authorization"] = f"Bearer {token}"
    return headers


def network_error(where: str, exc: Exception) -> PullError:
    """One line for whatever the transport raised: refused, unresolvable, timed out, cut."""
    kind = {
        httpx.ConnectError: "cannot connect",
        httpx.TimeoutException: "timed out",
    }
    what = next((v for k, v in kind.items() if isinstance(exc, k)), "network error")
    detail = str(exc).splitlines()[0][:200] if str(exc) else exc.__class__.__name__
    return PullError(f"{where}: {what} ({detail}); check the network or HF_ENDPOINT")


NETWORK_ERRORS = (httpx.HTTPError, httpx.InvalidURL)


class HubClient:
    def __init__(self) -> None:
        self.endpoint = endpoint()
        self.http = httpx.Client(headers=_headers(), timeout=TIMEOUT, follow_redirects=True)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> HubClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def listing(self, repo_id: str, revision: str) -> Listing:
        url = f"{self.endpoint}/api/models/{repo_id}/revision/{quote(revision, safe='')}"
        try:
            with self.http.stream("GET", url, params={"blobs": "true"}) as response:
                _raise_for_status(response, repo_id, revision)
                body = bytearray()
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    body += chunk
                    if len(body) > MAX_LISTING_BYTES:
                        raise PullError(
                            f"{repo_id}: the Hub's file list is over {MAX_LISTING_BYTES} bytes"
                        )
        except NETWORK_ERRORS as exc:
            raise network_error(f"{repo_id}: the Hub at {self.endpoint}", exc) from None
        try:
            return parse_listing(json.loads(body))
        except (ValueError, RecursionError) as exc:
            raise PullError(
                f"{repo_id}: the Hub's answer is not a file list ({str(exc)[:200]})"
            ) from None
        except UnsafeName as exc:
            raise PullError(f"{repo_id}: {exc}") from None

    def stream(self, repo_id: str, commit: str, name: str, offset: int) -> _Stream:
        """A context for the file's bytes from `offset`: yields (the offset they start at, chunks).
        A server that ignores the Range starts at 0; one that answers another range is refused."""
        url = f"{self.endpoint}/{repo_id}/resolve/{commit}/{quote(name)}"
        headers = {"range": f"bytes={offset}-"} if offset else {}
        return _Stream(self.http, url, headers, repo_id, name, offset)


class _Stream:
    def __init__(
        self,
        http: httpx.Client,
        url: str,
        headers: dict[str, str],
        repo_id: str,
        name: str,
        offset: int,
    ) -> None:
        self._ctx = http.stream("GET", url, headers=headers)
        self.repo_id, self.name, self.offset = repo_id, name, offset

    def __enter__(self) -> tuple[int, Iterator[bytes]]:
        response = self._ctx.__enter__()
        try:
            _raise_for_status(response, self.repo_id, None, self.name)
            start = 0
            if response.status_code == 206:
                got = response.headers.get("content-range", "")
                if not got.startswith(f"bytes {self.offset}-"):
                    raise PullError(
                        f"{self.repo_id}: {self.name}: asked for bytes {self.offset}- and got "
                        f"{got[:80]!r}"
                    )
                start = self.offset
        except BaseException:
            self._ctx.__exit__(None, None, None)
            raise
        return start, response.iter_bytes()  # as they arrive: a partial file keeps every byte

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


def _raise_for_status(
    response: httpx.Response, repo_id: str, revision: str | None, name: str | None = None
) -> None:
    status = response.status_code
    if status in (200, 206):
        return
    code = response.headers.get("x-error-code", "")
    what = f"{repo_id}" + (f" revision {revision!r}" if revision else "")
    if code == "GatedRepo":
        raise PullError(f"{repo_id!r} is gated: accept its terms on the Hub, then set HF_TOKEN")
    if name is None and (code in ("RepoNotFound", "RevisionNotFound") or status in (401, 404)):
        raise PullError(f"{what} is not on the Hub ({code or status})")
    if name is not None and status == 404:
        raise PullError(f"{repo_id}: the Hub listed {name} but does not serve it (404)")
    raise PullError(f"{what}: the Hub answered HTTP {status}" + (f" for {name}" if name else ""))


def parse_listing(data: object) -> Listing:
    """The commit and every file (name, size, hash) of a `?blobs=true` model info answer."""
    if not isinstance(data, dict) or not isinstance(data.get("siblings"), list):
        raise ValueError("no `siblings` list")
    commit = check_commit(data.get("sha"))
    files = []
    for sibling in data["siblings"]:
        if not isinstance(sibling, dict):
            raise ValueError("a sibling is not an object")
        name = check_file_name(sibling.get("rfilename"))
        lfs = sibling.get("lfs")
        if isinstance(lfs, dict):
            blob_id, kind, size = lfs.get("sha256"), HashKind.SHA256, lfs.get("size")
        else:
            blob_id, kind, size = sibling.get("blobId"), HashKind.GIT_SHA1, sibling.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"{name} has no size")
        files.append(HubFile(name, size, check_blob_id(blob_id, name), kind))
    return Listing(commit, tuple(sorted(files, key=lambda f: f.name)))
