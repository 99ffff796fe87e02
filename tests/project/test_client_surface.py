"""One client surface: the sync Client and the AsyncClient (both over client/core.py) offer the same
public methods with the same signatures; each of the async one's is awaited or iterated with
`async for`, each of the sync one's called plainly."""

from __future__ import annotations

import inspect

from moed.client.async_client import AsyncClient
from moed.client.client import Client


def _awaited(signature: inspect.Signature) -> inspect.Signature:
    """The async form of a sync signature: an Iterator of events becomes an AsyncIterator."""
    ret = signature.return_annotation
    if isinstance(ret, str) and ret.startswith("Iterator["):
        return signature.replace(return_annotation=f"Async{ret}")
    return signature


def _public(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def test_the_two_clients_have_the_same_methods_and_signatures():
    sync, async_ = _public(Client), _public(AsyncClient)
    assert sorted(sync) == sorted(async_), (
        f"only in Client: {sorted(set(sync) - set(async_))}; "
        f"only in AsyncClient: {sorted(set(async_) - set(sync))}"
    )
    differ = {
        name: (str(inspect.signature(sync[name])), str(inspect.signature(async_[name])))
        for name in sync
        if _awaited(inspect.signature(sync[name])) != inspect.signature(async_[name])
    }
    assert not differ, f"signatures differ (Client, AsyncClient): {differ}"


def test_each_async_method_is_awaited_where_the_sync_one_talks_to_the_daemon():
    own = set(vars(Client)) | set(vars(AsyncClient))  # the core's helpers are shared, plain
    for name, method in _public(AsyncClient).items():
        if name not in own:
            continue
        if name == "generate":
            assert inspect.isasyncgenfunction(method)
            assert inspect.isgeneratorfunction(_public(Client)[name])
        else:
            assert inspect.iscoroutinefunction(method), f"AsyncClient.{name} is not async"
            assert not inspect.iscoroutinefunction(_public(Client)[name])


def test_generate_takes_the_prompt_first_in_both():
    for cls in (Client, AsyncClient):
        first = list(inspect.signature(cls.generate).parameters)[1]
        assert first == "prompt", f"{cls.__name__}.generate's first argument is {first!r}"
