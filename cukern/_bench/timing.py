"""Timing with CUDA events: warm-up, input sets rotated past the L2, alternating blocks, the
device held busy while the host queues; the ceilings (copy bandwidth, matrix rate)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .._bench_cases import generator, randn
from .results import gbps, tflops

# ---- timing ----------------------------------------------------------------------------------

@dataclass
class Timing:
    """CUDA-event times of one function: the median, every sample, and the host's time per
    call (Python overhead and launch, taken from the warm-up, not part of the samples)."""
    median_ms: float
    samples_ms: list[float]
    host_ms: float


_sleep_cycles_per_ms: float | None = None


def _cycles_per_ms() -> float:
    """The rate of ``torch.cuda._sleep`` (GPU clock cycles a millisecond), measured once; 0
    when torch has no such function."""
    global _sleep_cycles_per_ms
    if _sleep_cycles_per_ms is None:
        import torch

        try:
            torch.cuda._sleep(1000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 10_000_000
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            _sleep_cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)
        except Exception:  # noqa: BLE001 - a private function: do without it
            _sleep_cycles_per_ms = 0.0
    return _sleep_cycles_per_ms


def _hold_device(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` so that the host can queue the timed calls
    ahead of the device: the events then time the kernels, not the host's launch overhead."""
    rate = _cycles_per_ms()
    if rate and ms > 0:
        import torch

        torch.cuda._sleep(int(min(ms, 2000.0) * rate))


def _calls(fn: Callable, sets: list | None) -> Callable[[int], object]:
    return (lambda i: fn(sets[i % len(sets)])) if sets is not None else (lambda i: fn())


def _warm(call: Callable[[int], object], warmup: int) -> float:
    """The first call (it compiles and allocates), then ``warmup`` more; the host's time per call
    of those in milliseconds."""
    import torch

    call(0)
    torch.cuda.synchronize()
    warmup = max(1, warmup)
    t0 = time.perf_counter()
    for i in range(warmup):
        call(1 + i)
    host_ms = (time.perf_counter() - t0) * 1e3 / warmup
    torch.cuda.synchronize()
    return host_ms


def _timed(call: Callable[[int], object], first: int, reps: int, host_ms: float, hold: bool) -> list[float]:
    """Calls ``first`` .. ``first + reps - 1``, each between two CUDA events; their times."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    if hold:
        _hold_device(1.0 + 1.25 * host_ms * reps)
    for i in range(reps):
        starts[i].record()
        call(first + i)
        ends[i].record()
        if not hold:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def time_cuda_detail(fn: Callable, *, warmup: int = 10, reps: int = 100,
                     input_sets: Sequence | None = None, hold: bool = True) -> Timing:
    """Time ``fn`` with a CUDA event pair around each of ``reps`` calls after ``warmup`` calls.

    With ``input_sets``, call ``i`` is ``fn(input_sets[i % len(input_sets)])``; else ``fn()``.
    Events are recorded on torch's current stream, where cukern launches for torch tensors.
    Before the timed calls the stream is held busy (``torch.cuda._sleep``) for as long as the
    host needs to queue them, so a sample is the device's time for one call. With
    ``hold=False`` each call is timed alone after the device has drained (synchronizing
    before each), so the host time in front of its kernels shows: an isolated call.
    """
    call = _calls(fn, list(input_sets) if input_sets is not None else None)
    host_ms = _warm(call, warmup)
    samples = _timed(call, 1 + max(1, warmup), reps, host_ms, hold)
    return Timing(statistics.median(samples), samples, host_ms)


def time_cuda_interleaved(fns: Sequence[Callable], *, warmup: int = 10, reps: int = 100,
                          input_sets: Sequence | None = None, rounds: int = 4) -> list[Timing]:
    """Time several functions as ``time_cuda_detail`` does, each ``reps`` calls, but in
    ``rounds`` blocks taken in turn (the first of a round rotating), so that a drift of the
    device's clocks over the run (a GPU slows as it heats) falls on all of them alike, not on
    whichever was timed last. Every block is held for as long as the slowest host needs: the
    hold idles the device, and a longer idle before one side's blocks raised its clock under
    the power cap (about 1% at d128 attention on an H200). One ``Timing`` a function, in the order given."""
    sets = list(input_sets) if input_sets is not None else None
    calls = [_calls(fn, sets) for fn in fns]
    host = [_warm(call, warmup) for call in calls]
    hold_ms = max(host)
    samples: list[list[float]] = [[] for _ in fns]
    rounds = max(1, min(rounds, reps))
    for r in range(rounds):
        block = reps // rounds + (r < reps % rounds)
        for k in range(len(fns)):
            j = (r + k) % len(fns)
            samples[j] += _timed(calls[j], 1 + max(1, warmup) + len(samples[j]), block, hold_ms, True)
    return [Timing(statistics.median(x), x, h) for x, h in zip(samples, host)]


def host_us(fn: Callable, *, calls: int = 100, input_sets: Sequence | None = None) -> float:
    """Host time a call in microseconds, with the device kept busy: the calls are queued
    behind a long sleep kernel, so none waits for the device and the host clock measures what
    Python, the framework and the driver spend in front of the kernels."""
    import torch

    call = _calls(fn, list(input_sets) if input_sets is not None else None)
    for i in range(3):
        call(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call(0)
    probe_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    _hold_device(5.0 + 2.0 * probe_ms * calls)
    t0 = time.perf_counter()
    for i in range(calls):
        call(i)
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def time_cuda(fn: Callable, *, warmup: int = 10, reps: int = 100,
              input_sets: Sequence | None = None) -> float:
    """The median time of ``fn`` in milliseconds; see ``time_cuda_detail``."""
    return time_cuda_detail(fn, warmup=warmup, reps=reps, input_sets=input_sets).median_ms


def l2_bytes(device: int = 0) -> int:
    import torch

    return torch.cuda.get_device_properties(device).L2_cache_size


def copy_bandwidth(nbytes: int = 1 << 30, *, warmup: int = 5, reps: int = 50) -> float:
    """The device-to-device copy rate, GB/s, counting bytes read + written: ``dst.copy_(src)``
    of ``nbytes`` (at least 8 times the L2 size) of random data."""
    import torch

    nbytes = max(nbytes, 8 * l2_bytes())
    src = randn((nbytes // 2,), "bfloat16", generator(0))
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), warmup=warmup, reps=reps)
    return gbps(2 * src.numel() * src.element_size(), ms)


def matmul_rate(n: int = 8192, *, warmup: int = 5, reps: int = 30) -> float:
    """The bf16 matrix-product rate, TFLOP/s, of torch's ``n``x``n``x``n`` product."""
    import torch

    gen = generator(0)
    a, b = randn((n, n), "bfloat16", gen), randn((n, n), "bfloat16", gen)
    ms = time_cuda(lambda: torch.mm(a, b), warmup=warmup, reps=reps)
    return tflops(2 * n ** 3, ms)
