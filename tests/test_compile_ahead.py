"""Compiling ahead of need, with no GPU: different kernel instances compile at once on different
threads and the same one once; a backward's plan is built ahead (its kernels compiled) without
running anything."""
from __future__ import annotations

import threading
import time

import pytest

from cukern import _kernels, _plans


@pytest.fixture
def fake_compiles(monkeypatch):
    """_kernels.function with the compile replaced by a 0.2 s sleep that records what it built
    and how many ran at once; an instance named "bad" fails its first compile."""
    seen = {"built": [], "running": 0, "most": 0, "failed": 0}
    lock = threading.Lock()

    def compile_(source, instance, device):
        with lock:
            seen["running"] += 1
            seen["most"] = max(seen["most"], seen["running"])
        time.sleep(0.2)
        with lock:
            seen["running"] -= 1
            if instance == "bad" and not seen["failed"]:
                seen["failed"] += 1
                raise _kernels.CompileError(instance, "error: a broken kernel")
            seen["built"].append(instance)
        return f"fn:{instance}:{device}"

    monkeypatch.setattr(_kernels, "_cupy_function", compile_)
    monkeypatch.setattr(_kernels, "check_capability", lambda device: None)
    monkeypatch.setattr(_kernels, "_functions", {})
    monkeypatch.setattr(_kernels, "_compiling", {})
    return seen


def _in_threads(*calls):
    results, errors = [None] * len(calls), [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except Exception as e:  # noqa: BLE001 - handed back to the test
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def test_different_instances_compile_at_once_and_one_instance_once(fake_compiles):
    t0 = time.perf_counter()
    results, errors = _in_threads(*[lambda i=i: _kernels.function("x.cu", f"k<{i % 3}>", 0) for i in range(6)])
    took = time.perf_counter() - t0
    assert errors == [None] * 6
    assert results == [f"fn:k<{i % 3}>:0" for i in range(6)]
    assert sorted(fake_compiles["built"]) == ["k<0>", "k<1>", "k<2>"]   # each once
    assert fake_compiles["most"] == 3 and took < 0.5   # (one at a time: 0.6 s)
    assert _kernels.function("x.cu", "k<1>", 0) == "fn:k<1>:0" and len(fake_compiles["built"]) == 3


def test_a_failed_compile_reaches_every_waiter_and_is_tried_again(fake_compiles):
    _, errors = _in_threads(*[lambda: _kernels.function("x.cu", "bad", 0)] * 3)
    assert all(isinstance(e, _kernels.CompileError) and "broken" in str(e) for e in errors), errors
    assert _kernels._compiling == {}
    assert _kernels.function("x.cu", "bad", 0) == "fn:bad:0"


def test_background_work_runs_and_its_errors_are_dropped():
    done = threading.Event()

    def fail():
        raise RuntimeError("dropped")

    _kernels.in_background(fail)
    _kernels.in_background(done.set)
    assert done.wait(10)


def test_build_ahead_builds_and_keeps_the_plan_and_runs_nothing(monkeypatch):
    import contextlib

    from cukern import _arrays

    monkeypatch.setattr(_arrays, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_arrays, "launch_stream", lambda first: 0)
    cache, ran, built = _plans.PlanCache(), [], []

    def build():
        built.append(1)
        b = _plans.Builder([_arrays.DeviceArray(None, "cupy", 0x1000, (4,), (1,), "float32", 0, "x")])
        b.step(lambda bufs, ptrs, stream: ran.append(1))
        return b.plan(0)

    def front(x):
        plan = cache.plan(("key", x), build)
        plan([_arrays.DeviceArray(None, "cupy", 0x1000, (4,), (1,), "float32", 0, "x")])
        return "ran"

    assert _plans.build_ahead(front, 1) is True
    assert built == [1] and ran == [] and ("key", 1) in cache.plans
    # the same thread runs plans again afterwards, and inside a record block records them
    with _plans.record() as plans:
        assert front(1) == "ran"
    assert built == [1] and ran == [1] and len(plans) == 1
    assert _plans.build_ahead(lambda: None) is False
    with pytest.raises(ValueError, match="before the plan"):
        _plans.build_ahead(lambda: (_ for _ in ()).throw(ValueError("before the plan")))


def test_at_exit_background_work_under_way_is_waited_for_and_the_rest_dropped(monkeypatch):
    monkeypatch.setattr(_kernels, "_stopping", threading.Event())
    started, finished, dropped = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        time.sleep(0.3)
        finished.set()

    _kernels.in_background(slow)
    assert started.wait(10)
    for _ in range(8):   # (more than the workers: some wait in the queue when the drain starts)
        _kernels.in_background(dropped.append, 1)
    assert _kernels._drain(timeout=10) is True
    assert finished.is_set()   # the task under way ran to its end
    time.sleep(0.2)
    assert len(dropped) < 8    # queued work after the drain is dropped
