"""The forward batcher's scheduling: alone while the cores have room, together past that, alone again once the crowd
has gone (a fake model, no torch work)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from moaspec.batching import ForwardBatcher
from moaspec.models.kv_cache import KVCache
from moaspec.models.transformer import Call


class FakeModel:
    """Forwards that block until released, and a log of how they ran."""

    def __init__(self, fail: bool = False) -> None:
        self.release, self.log, self.fail = threading.Event(), [], fail

    def __call__(self, tokens, cache, positions, mask, logits_at):  # type: ignore[no-untyped-def]
        self.log.append(("alone", int(tokens[0, 0])))
        self.release.wait(10)
        return f"alone {int(tokens[0, 0])}"

    def forward_many(self, calls):  # type: ignore[no-untyped-def]
        self.log.append(("together", sorted(int(c.tokens[0, 0]) for c in calls)))
        if self.fail:
            raise RuntimeError("the batch failed")
        return [f"together {int(c.tokens[0, 0])}" for c in calls]


def call(k: int, length: int = 0) -> Call:
    cache = KVCache(1, 1, 1, capacity=8)  # a real one, for its room check; the fake model writes nothing
    cache.length = length
    return Call(torch.tensor([[k]]), cache)


def wait_for(condition) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the batcher did not get there"
        time.sleep(0.005)


def test_forwards_run_alone_while_lanes_are_free_and_together_past_them() -> None:
    model = FakeModel()
    batcher = ForwardBatcher(model, lanes=2)  # type: ignore[arg-type]
    with ThreadPoolExecutor(5) as pool:
        first = [pool.submit(batcher.forward, call(k)) for k in (1, 2)]
        wait_for(lambda: len(model.log) == 2)  # both run at once, each on its own
        assert not batcher.crowded()  # as many forwards as lanes: nothing waits, speculation may pay
        rest = [pool.submit(batcher.forward, call(k)) for k in (3, 4, 5)]
        wait_for(lambda: batcher._waiting == 3)  # no lane is free: they queue
        assert batcher.crowded()
        assert model.log == [("alone", 1), ("alone", 2)]
        model.release.set()
        assert [f.result(10) for f in first + rest] == ["alone 1", "alone 2", "together 3", "together 4", "together 5"]
    assert model.log[2:] == [("together", [3, 4, 5])]
    assert (batcher.forwards, batcher.runs) == (5, 3)
    assert batcher.crowded() and batcher.forward(call(6)) == "together 6"  # after a crowded batch, the next one goes
    # through the queue, and once a batch held one forward alone, forwards run at once again
    assert not batcher.crowded() and batcher.forward(call(7)) == "alone 7"


def test_a_failed_batch_fails_its_callers_alone_and_the_batcher_serves_on() -> None:
    model = FakeModel(fail=True)
    batcher = ForwardBatcher(model, lanes=1)  # type: ignore[arg-type]
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(batcher.forward, call(1))
        wait_for(lambda: len(model.log) == 1)
        queued = [pool.submit(batcher.forward, call(k)) for k in (2, 3)]
        wait_for(lambda: batcher._waiting == 2)
        model.release.set()
        assert first.result(10) == "alone 1"
        for f in queued:
            with pytest.raises(RuntimeError, match="the batch failed"):
                f.result(10)
    with pytest.raises(ValueError, match="cache overflow"):  # refused before it could join (and fail) a batch
        batcher.forward(call(7, length=8))
    model.fail = False
    assert [batcher.forward(call(k)) for k in (8, 9)] == ["together 8", "alone 9"]  # it serves on
