"""The collector of long-running processes (app.core.collector): what is alive at a tick is
frozen, so that collections walk only newer objects; the periodic full collection thaws,
collects reference cycles among the frozen objects, and freezes again."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from app.core.collector import API_YOUNG, WORKER_YOUNG, Collector, collector_loop


@pytest.fixture
def thawed() -> Iterator[None]:
    gc.unfreeze()
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()


class Node:
    def __init__(self) -> None:
        self.other: Any = None


def test_a_tick_freezes_what_is_alive_and_a_full_pass_collects_frozen_cycles(
        thawed: None) -> None:
    collector = Collector(freeze_s=0.05, full_s=3600.0)
    collector.tick()
    assert gc.get_freeze_count() == 0  # too early
    a, b = Node(), Node()
    a.other, b.other = b, a  # a reference cycle
    gone = weakref.ref(a)
    time.sleep(0.06)
    collector.tick()
    assert gc.get_freeze_count() > 0
    del a, b
    gc.collect()
    assert gone() is not None  # frozen: not walked by collections
    collector.full_s = 0.0
    collector.tick()
    assert gone() is None  # the full pass thaws and collects it
    assert gc.get_freeze_count() > 0  # and freezes again


def test_the_youngest_generation_is_collected_less_often(thawed: None) -> None:
    """`Collector()` keeps Python's threshold; a worker's and an api process's loop
    (`collector_loop`) collect the youngest generation every 20 000 allocations."""
    gc.set_threshold(700, 10, 10)
    Collector()
    assert gc.get_threshold() == (700, 10, 10)
    Collector(young=WORKER_YOUNG)
    assert gc.get_threshold() == (WORKER_YOUNG, 10, 10)
    gc.set_threshold(700, 10, 10)

    async def api_process() -> None:
        loop = asyncio.create_task(collector_loop())
        await asyncio.sleep(0)  # (it makes its collector, then sleeps)
        loop.cancel()

    asyncio.run(api_process())
    assert gc.get_threshold() == (API_YOUNG, 10, 10)
