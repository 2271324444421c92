"""The dispatcher's batched writes: one call at a time, waiting batches go together."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.dispatcher.records import WriteBatcher


async def test_batches_that_wait_are_run_together_and_answered_in_order() -> None:
    calls: list[list[int]] = []
    gate = asyncio.Event()

    async def double(items: list[int]) -> list[int]:
        calls.append(items)
        if len(calls) == 1:
            await gate.wait()  # the first call is slow: the others queue up behind it
        return [2 * i for i in items]

    batcher: WriteBatcher[int, int] = WriteBatcher(double, most=10)
    first = asyncio.create_task(batcher.submit([1]))
    await asyncio.sleep(0)
    waiting = [asyncio.create_task(batcher.submit(b)) for b in ([2, 3], [4], [5, 6, 7])]
    await asyncio.sleep(0)
    gate.set()
    assert await first == [2]
    assert [await t for t in waiting] == [[4, 6], [8], [10, 12, 14]]
    assert calls == [[1], [2, 3, 4, 5, 6, 7]]


async def test_a_round_is_capped_at_most_items() -> None:
    calls: list[list[int]] = []
    gate = asyncio.Event()

    async def echo(items: list[int]) -> list[int]:
        calls.append(items)
        await gate.wait()
        return items

    batcher: WriteBatcher[int, int] = WriteBatcher(echo, most=3)
    tasks = [asyncio.create_task(batcher.submit([i, i])) for i in range(3)]
    await asyncio.sleep(0)
    gate.set()
    assert [await t for t in tasks] == [[0, 0], [1, 1], [2, 2]]
    assert calls == [[0, 0], [1, 1], [2, 2]]


async def test_an_error_reaches_every_caller_of_its_round_only() -> None:
    rounds = 0

    async def flaky(items: list[int]) -> list[int]:
        nonlocal rounds
        rounds += 1
        await asyncio.sleep(0.01)
        if rounds == 1:
            raise ConnectionError("database went away")
        return items

    batcher: WriteBatcher[int, int] = WriteBatcher(flaky, most=10)
    first = asyncio.create_task(batcher.submit([1]))
    await asyncio.sleep(0)
    second = asyncio.create_task(batcher.submit([2]))
    with pytest.raises(ConnectionError):
        await first
    assert await second == [2]
