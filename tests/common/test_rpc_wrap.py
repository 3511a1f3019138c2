"""common/rpc_wrap.py's ``delegate``: what is thrown into the wrapper reaches the behaviour it
wraps, as the shutdown's expiry needs (a plain ``async for ... yield`` wrapper raised it in
itself, and the call ended with gRPC's hard-stop status instead of the behaviour's ABORT)."""

from __future__ import annotations

import asyncio

import pytest

from common.rpc_wrap import delegate


def run(coro):
    return asyncio.run(coro)


async def behaviour(log: list[str]):
    try:
        yield "token"
        yield "token"
    except asyncio.CancelledError:
        log.append("handled")
        yield "abort"  # the behaviour's own last message
    finally:
        log.append("closed")


def test_an_exception_thrown_in_reaches_the_inner_behaviour():
    async def scenario():
        log: list[str] = []
        outer = delegate(behaviour(log))
        first = await outer.__anext__()
        last = await outer.athrow(asyncio.CancelledError())
        with pytest.raises(StopAsyncIteration):
            await outer.__anext__()
        return first, last, log

    assert run(scenario()) == ("token", "abort", ["handled", "closed"])


def test_what_the_inner_does_not_handle_comes_back_out():
    async def scenario():
        log: list[str] = []
        outer = delegate(behaviour(log))
        await outer.__anext__()
        with pytest.raises(ValueError):
            await outer.athrow(ValueError("not for it"))
        return log

    assert run(scenario()) == ["closed"]


def test_before_runs_first_and_closing_the_wrapper_closes_the_behaviour():
    async def scenario():
        log: list[str] = []

        async def before():
            log.append("before")

        outer = delegate(behaviour(log), before())
        items = [await outer.__anext__()]
        await outer.aclose()
        return items, log

    assert run(scenario()) == (["token"], ["before", "closed"])


def test_every_item_comes_through_in_order():
    async def numbers():
        for i in range(5):
            yield i

    async def scenario():
        return [i async for i in delegate(numbers())]

    assert run(scenario()) == [0, 1, 2, 3, 4]
