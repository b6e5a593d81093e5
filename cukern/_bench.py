"""The benchmark mechanism shared by ``python -m cukern bench`` and the asv suite (asv_bench/).

Every case times cukern against the PyTorch equivalent in one process, on torch tensors (cukern
takes them zero-copy), with CUDA events on torch's current stream: the median of many runs
after warm-up, taken in blocks that alternate between the two (a clock drift falls on both).
Each result is also given as a ratio to a ceiling measured in the same run: the device's
device-to-device copy bandwidth for memory-bound ops (bytes read + written), the bf16
matrix-product rate for FLOP-bound ones. Absolute times move between machines and runs; ratios
taken in one run hold.

Two kinds of case, both declared by the families (``bench`` and ``torch_bench`` of each
``FAMILY``) and discovered here:

* :class:`Case`: the array API against PyTorch's op (``python -m cukern bench``);
* :class:`TorchCase`: the op as a PyTorch user runs it, through ``cukern.torch`` with
  autograd, against PyTorch eager, ``torch.compile`` and Liger-Kernel when it is installed,
  with the array API's time for the same work and the host time a call
  (``python -m cukern bench --torch``).

torch and CuPy are imported only inside the functions that run on the GPU, so ``import cukern``
(and ``import cukern._bench``) never imports them.
"""
from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ._bench_cases import (ITEMSIZE, SHORT_DTYPE, Case, TorchCase, _shape_label, elements_bytes,  # noqa: F401
                           generator, randn)
from ._version import __version__

__all__ = ["Case", "TorchCase", "Timing", "cases", "torch_cases", "time_cuda", "time_cuda_detail",
           "time_cuda_interleaved", "host_us",
           "copy_bandwidth", "matmul_rate", "run_cases", "run_case", "run_torch_cases", "summarize",
           "format_table", "format_torch_table", "unavailable_reason", "asv_results", "asv_benchmarks"]

# Rotate among input sets until one round touches at least this many times the L2 size.
L2_FACTOR = 4
MAX_INPUT_SETS = 16

# Largest relative L2 difference from torch's outputs still reported as agreeing (per dtype;
# both sides round their outputs to the dtype).
AGREE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


# ---- cases ----------------------------------------------------------------------------------

def slug(name: str) -> str:
    """A case name as an identifier: ``"layer_norm fwd+bwd"`` -> ``"layer_norm_fwd_bwd"``."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")


def cases(quick: bool = False, family: str | None = None) -> list[Case]:
    """Every array-API case of every family, in table order; ``quick`` takes smaller shapes."""
    from ._registry import families

    return [c for f in families() if f.bench and family in (None, f.name) for c in f.bench(quick)]


def torch_cases(quick: bool = False, family: str | None = None) -> list[TorchCase]:
    """Every PyTorch-path case of every family (``bench --torch``)."""
    from ._registry import families

    return [c for f in families() if f.torch_bench and family in (None, f.name) for c in f.torch_bench(quick)]


def gbps(nbytes: int, ms: float) -> float:
    """Bytes moved in ``ms`` milliseconds, in GB/s (10^9 bytes a second)."""
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def input_set_count(set_bytes: int, l2_bytes: int, factor: int = L2_FACTOR,
                    cap: int = MAX_INPUT_SETS) -> int:
    """How many input sets to rotate so that one round touches ``factor`` times the L2 size."""
    if set_bytes <= 0:
        return 1
    return max(1, min(cap, -(-factor * l2_bytes // set_bytes)))


def summarize(case: Case, cukern_ms: float, torch_ms: float, *, copy_gbps: float | None = None,
              matmul_tflops: float | None = None) -> dict:
    """The result record of one case from its two median times (and the ceilings)."""
    r = {"name": case.name, "family": case.family, "shape": list(case.shape), "dtype": case.dtype,
         "bytes": case.nbytes, "flops": case.flops, "cukern_ms": cukern_ms, "torch_ms": torch_ms,
         "gbps": None, "torch_gbps": None, "pct_of_copy": None,
         "tflops": None, "torch_tflops": None, "pct_of_matmul": None,
         "speedup": torch_ms / cukern_ms if cukern_ms > 0 else None}
    if case.flops is None:
        r["gbps"] = gbps(case.nbytes, cukern_ms)
        r["torch_gbps"] = gbps(case.nbytes, torch_ms)
        if copy_gbps:
            r["pct_of_copy"] = 100.0 * r["gbps"] / copy_gbps
    else:
        r["tflops"] = tflops(case.flops, cukern_ms)
        r["torch_tflops"] = tflops(case.flops, torch_ms)
        if matmul_tflops:
            r["pct_of_matmul"] = 100.0 * r["tflops"] / matmul_tflops
    return r


def error_result(case: Case, error: str) -> dict:
    return {"name": case.name, "family": case.family, "shape": list(case.shape),
            "dtype": case.dtype, "bytes": case.nbytes, "flops": case.flops, "error": error}


def format_table(results: list[dict]) -> str:
    """The results as a fixed-width text table (one row a case)."""
    head = ("case", "shape", "cukern ms", "torch ms", "rate", "% of ceiling", "speed-up")
    rows = []
    for r in results:
        shape = "x".join(str(n) for n in r["shape"]) + " " + SHORT_DTYPE.get(r["dtype"], r["dtype"])
        if r.get("error"):
            rows.append((r["name"], shape, "error", "", "", "", ""))
            continue
        if r.get("tflops") is not None:
            rate = f"{r['tflops']:.0f} TFLOP/s"
            pct = f"{r['pct_of_matmul']:.1f}% matmul" if r.get("pct_of_matmul") is not None else "-"
        else:
            rate = f"{r['gbps']:.0f} GB/s"
            pct = f"{r['pct_of_copy']:.1f}% copy" if r.get("pct_of_copy") is not None else "-"
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
        rows.append((r["name"], shape, f"{r['cukern_ms']:.3f}", f"{r['torch_ms']:.3f}", rate, pct,
                     speed))
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    left = {0, 1}

    def line(row):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    out = [line(head), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in rows]
    notes = []
    for r in results:
        if r.get("error"):
            notes.append(f"{r['name']}: {r['error']}")
        elif r.get("rel_err") is not None and not r.get("agrees", True):
            notes.append(f"{r['name']}: cukern and torch outputs differ (relative L2 error "
                         f"{r['rel_err']:.2e}); the timing compares different answers")
    if notes:
        out.append("")
        out += [f"! {n}" for n in notes]
    return "\n".join(out)


# ---- the environment -------------------------------------------------------------------------

def unavailable_reason() -> str | None:
    """None when a CUDA GPU, a CUDA build of torch and CuPy are all there; else what is missing."""
    problems = []
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken installation
        torch = None
        problems.append(f"PyTorch is not installed ({type(e).__name__}: {e}); the benchmark "
                        "compares against torch and times with torch.cuda events")
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        from ._environment import INSTALL_HINT

        cupy = None
        problems.append(f"CuPy is not installed ({type(e).__name__}: {e}); cukern launches its kernels "
                        f"through it: {INSTALL_HINT}, which brings CuPy with [ctk] (NVRTC and the CUDA headers)")
    gpu = None
    if cupy is not None:
        try:
            n = cupy.cuda.runtime.getDeviceCount()
            gpu = None if n > 0 else "the CUDA runtime reports 0 devices"
        except Exception as e:  # noqa: BLE001 - no driver, no device: the same answer
            gpu = f"{type(e).__name__}: {e}"
    if torch is not None:
        if torch.version.cuda is None:
            problems.append(f"PyTorch {torch.__version__} is a build without CUDA "
                            "(torch.version.cuda is None); install a CUDA build")
        elif gpu is None and not torch.cuda.is_available():
            gpu = "torch.cuda.is_available() is False"
    if gpu is not None:
        problems.insert(0, f"no CUDA GPU found ({gpu})")
    return "; ".join(problems) if problems else None


def device_info(device: int = 0) -> dict:
    import torch

    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "memory_bytes": p.total_memory, "l2_bytes": p.L2_cache_size}


def versions() -> dict:
    import cupy
    import torch

    from . import _nvrtc

    try:
        nvrtc = "%d.%d" % _nvrtc.version()
    except Exception as e:  # noqa: BLE001
        nvrtc = f"unavailable ({e})"
    return {"cukern": __version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cupy": cupy.__version__, "nvrtc": nvrtc}


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


# ---- running cases ---------------------------------------------------------------------------

def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def relative_error(ours, theirs) -> float:
    """The largest relative L2 difference ``|a - b| / |b|`` over corresponding outputs
    (inf for a shape mismatch or a missing output; NaN never counts as agreeing)."""
    import torch

    ours, theirs = _as_tuple(ours), _as_tuple(theirs)
    if len(ours) != len(theirs):
        return math.inf
    worst = 0.0
    for a, b in zip(ours, theirs):
        if a is None or b is None:
            if a is not b:
                return math.inf
            continue
        if tuple(a.shape) != tuple(b.shape):
            return math.inf
        a, b = a.detach().float(), b.detach().float()
        ref = torch.linalg.vector_norm(b).item()
        diff = torch.linalg.vector_norm(a - b).item()
        err = diff / ref if ref > 0 else diff
        if math.isnan(err):
            return math.nan
        worst = max(worst, err)
    return worst


def run_case(case: Case, *, warmup: int = 10, reps: int = 100, copy_gbps: float | None = None,
             matmul_tflops: float | None = None, l2: int | None = None) -> dict:
    """Build the inputs, check cukern against torch once, time both; the result record."""
    import torch

    nsets = input_set_count(case.nbytes, l2 if l2 is not None else l2_bytes())
    sets = [case.make(seed) for seed in range(nsets)]
    err = relative_error(case.cukern_fn(sets[0]), case.torch_fn(sets[0]))
    torch.cuda.synchronize()
    tc, tt = time_cuda_interleaved([case.cukern_fn, case.torch_fn], warmup=warmup, reps=reps, input_sets=sets)
    r = summarize(case, tc.median_ms, tt.median_ms, copy_gbps=copy_gbps, matmul_tflops=matmul_tflops)
    r.update(rel_err=err, agrees=bool(err <= AGREE.get(case.dtype, 2e-2)), input_sets=nsets,
             reps=reps, cukern_host_us=1e3 * tc.host_ms, torch_host_us=1e3 * tt.host_ms)
    return r


def run_cases(cases: Sequence[Case], progress: Callable[[int, int, Case], None] | None = None, *,
              warmup: int = 10, reps: int = 100, copy_gbps: float | None = None,
              matmul_tflops: float | None = None) -> list[dict]:
    """Run every case; a list of result dicts (see ``summarize``) in the order given.

    The ceilings are measured here when not given and some case needs them. ``progress(i, n,
    case)`` is called before case ``i`` (from 1) of ``n``. A case that raises gets a record
    with ``error`` set, and the others still run.
    """
    if copy_gbps is None and any(c.flops is None for c in cases):
        copy_gbps = copy_bandwidth()
    if matmul_tflops is None and any(c.flops is not None for c in cases):
        matmul_tflops = matmul_rate()
    return _run_each(run_case, cases, progress, warmup=warmup, reps=reps, copy_gbps=copy_gbps,
                     matmul_tflops=matmul_tflops)


def _run_each(run_one: Callable, cases: Sequence, progress: Callable | None, **kw) -> list[dict]:
    """``run_one(case, **kw, l2=...)`` for every case, in order; a case that raises gets a
    record with ``error`` set and the others still run."""
    import torch

    l2 = l2_bytes()
    results = []
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i + 1, len(cases), case)
        try:
            results.append(run_one(case, l2=l2, **kw))
        except Exception as e:  # noqa: BLE001 - report it in the table, run the next case
            results.append(error_result(case, f"{type(e).__name__}: {e}".strip()))
        torch.cuda.empty_cache()
    return results


# ---- the PyTorch path (bench --torch) ---------------------------------------------------------

TORCH_IMPLS = ("array", "cukern.torch", "eager", "compile", "liger")


def liger_version() -> str | None:
    """Liger-Kernel's version when it is installed (and importable), else None."""
    try:
        import liger_kernel  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or broken: no Liger column
        return None
    from importlib import metadata

    try:
        return metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        return "unknown"


def _step(case: TorchCase, forward: Callable, leaves: str = "leaves") -> Callable:
    """fn(t): the case's forward through ``forward`` (one output or a tuple) and, with
    ``case.backward``, the gradients of its leaves (``t[leaves]``) by ``torch.autograd.grad``
    from ``t["dy"]`` (a tuple for a tuple)."""
    import torch

    if case.backward:
        def run(t):   # (a forward of several outputs takes a tuple t["dy"] of their gradients)
            y = forward(t)
            ys = y if isinstance(y, tuple) else (y,)
            dys = t["dy"] if isinstance(t["dy"], tuple) else (t["dy"],)
            return (*(o.detach() for o in ys), *torch.autograd.grad(ys, t[leaves], dys))
    else:
        def run(t):
            with torch.no_grad():
                return forward(t)
    return run


def torch_impls(case: TorchCase) -> dict[str, Callable]:
    """The implementations a PyTorch-path case compares, by column name."""
    import functools

    import torch
    import torch.nn.functional as F

    import cukern.torch as ct

    # (each case compiles the same wrapper frame again: without a reset the ninth case hits
    # dynamo's recompile limit and its "compile" column silently runs eager)
    torch._dynamo.reset()
    impls = {"array": case.array,
             "cukern.torch": _step(case, functools.partial(case.forward, ct)),
             "eager": _step(case, functools.partial(case.forward, F)),
             "compile": _step(case, torch.compile(functools.partial(case.forward, F)))}
    if case.liger is not None and liger_version() is not None:
        # (a case whose Liger function writes into its inputs gives it leaves of its own)
        impls["liger"] = _step(case, case.liger, "liger_leaves" if case.liger_leaves else "leaves")
    return impls


def peak_mib(fn: Callable, inputs) -> float:
    """The most memory one call of ``fn(inputs)`` allocates beyond what was allocated before it
    (its outputs and its scratch; the inputs excluded), in MiB, from torch's allocator."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(inputs)
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_torch_case(case: TorchCase, *, warmup: int = 10, reps: int = 100, copy_gbps: float | None = None,
                   matmul_tflops: float | None = None, l2: int | None = None) -> dict:
    """Time every implementation of a PyTorch-path case: the bench's method (device kept busy,
    median of events), one isolated call (the device idle before it, so host time in front of
    the kernels shows), and host microseconds a call."""
    import torch

    import cukern.torch as ct

    nsets = input_set_count(case.nbytes, l2 if l2 is not None else l2_bytes())
    sets = [case.make(seed) for seed in range(nsets)]
    impls = torch_impls(case)
    expect = impls["eager"](sets[0])
    errors = {name: relative_error(fn(sets[0]), expect) for name, fn in impls.items() if name != "eager"}
    ct.reset_counts()
    impls["cukern.torch"](sets[0])
    counts = ct.counts(reasons=True)
    # (None: the case calls a function of cukern.torch's own, no drop-in to count)
    routed = all(c["torch"] == 0 and c["cukern"] > 0 for c in counts.values()) if counts else None
    torch.cuda.synchronize()
    timings = time_cuda_interleaved(list(impls.values()), warmup=warmup, reps=reps, input_sets=sets)
    ms = {name: t.median_ms for name, t in zip(impls, timings)}
    isolated = {name: time_cuda_detail(impls[name], warmup=3, reps=max(5, reps // 4), input_sets=sets,
                                       hold=False).median_ms for name in ("cukern.torch", "eager")}
    host = {name: host_us(impls[name], calls=max(20, reps), input_sets=sets)
            for name in ("array", "cukern.torch", "eager")}
    peak = {name: peak_mib(fn, sets[0]) for name, fn in impls.items()}
    r = {"name": case.name, "family": case.family, "shape": list(case.shape), "dtype": case.dtype,
         "bytes": case.nbytes, "flops": case.flops, "ms": ms, "isolated_ms": isolated, "host_us": host,
         "peak_mib": peak,
         "rel_err": errors, "routed": routed, "fallbacks": {k: v.get("torch_reasons") for k, v in counts.items()
                                                             if v.get("torch")},
         "input_sets": nsets, "reps": reps}
    mine = ms["cukern.torch"]
    r["torch_over_array"] = mine / ms["array"] if ms["array"] > 0 else None
    for peer in ("eager", "compile", "liger"):
        r[f"vs_{peer}"] = ms[peer] / mine if peer in ms and mine > 0 else None
    r["host_vs_eager"] = host["cukern.torch"] / host["eager"] if host["eager"] > 0 else None
    if case.flops is None:
        r["gbps"] = gbps(case.nbytes, mine)
        r["pct_of_copy"] = 100.0 * r["gbps"] / copy_gbps if copy_gbps else None
    else:
        r["tflops"] = tflops(case.flops, mine)
        r["pct_of_matmul"] = 100.0 * r["tflops"] / matmul_tflops if matmul_tflops else None
    return r


def run_torch_cases(cases: Sequence[TorchCase], progress: Callable | None = None, *, warmup: int = 10,
                    reps: int = 100, copy_gbps: float | None = None, matmul_tflops: float | None = None) -> list[dict]:
    """Every PyTorch-path case; a case that raises gets a record with ``error`` set."""
    return _run_each(run_torch_case, cases, progress, warmup=warmup, reps=reps, copy_gbps=copy_gbps,
                     matmul_tflops=matmul_tflops)


def _peaks(peak: dict | None) -> str:
    if not peak:
        return "-"
    return " / ".join("-" if peak.get(k) is None else f"{peak[k]:.0f}" for k in ("cukern.torch", "eager", "liger"))


def format_torch_table(results: list[dict]) -> str:
    """The PyTorch-path results: median ms of each implementation (the bench's method), the
    ratios, the isolated call's time and the host time a call."""
    head = ("case", "shape", "array ms", "cukern.torch ms", "/array", "eager ms", "compile ms", "Liger ms",
            "vs eager", "vs compile", "vs Liger", "isolated ms (ct/eager)", "host us (ct/eager/array)",
            "peak MiB (ct/eager/Liger)")
    rows = []

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in results:
        shape = "x".join(str(n) for n in r["shape"]) + " " + SHORT_DTYPE.get(r["dtype"], r["dtype"])
        if r.get("error"):
            rows.append((r["name"], shape, "error") + ("",) * (len(head) - 3))
            continue
        ms, iso, host = r["ms"], r["isolated_ms"], r["host_us"]
        rows.append((r["name"] + (" (fell back!)" if r["routed"] is False else ""), shape, f(ms["array"], ".3f"),
                     f(ms["cukern.torch"], ".3f"), f(r["torch_over_array"], ".2f"), f(ms["eager"], ".3f"),
                     f(ms["compile"], ".3f"), f(ms.get("liger"), ".3f"), f(r["vs_eager"], ".2f") + "x",
                     f(r["vs_compile"], ".2f") + "x", f(r["vs_liger"], ".2f") + ("x" if r["vs_liger"] else ""),
                     f"{iso['cukern.torch']:.3f} / {iso['eager']:.3f}",
                     f"{host['cukern.torch']:.0f} / {host['eager']:.0f} / {host['array']:.0f}",
                     _peaks(r.get("peak_mib"))))
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    left = {0, 1}

    def line(row):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    out = [line(head), "  ".join("-" * w for w in widths)] + [line(row) for row in rows]
    notes = [f"! {r['name']}: {r['error']}" for r in results if r.get("error")]
    for r in results:
        if r.get("error"):
            continue
        bad = {k: v for k, v in r["rel_err"].items() if not v <= AGREE.get(r["dtype"], 2e-2)}
        if bad:
            notes.append(f"! {r['name']}: outputs differ from PyTorch eager's (relative L2 error "
                         + ", ".join(f"{k} {v:.2e}" for k, v in bad.items()) + ")")
        if r.get("fallbacks"):
            notes.append(f"! {r['name']}: cukern.torch fell back to PyTorch: {r['fallbacks']}")
    return "\n".join(out + ([""] + notes if notes else []))


# ---- asv -------------------------------------------------------------------------------------

ASV_TIMEOUT = 3600  # seconds: one setup_cache measures every case (and compiles the kernels)
# A benchmark's version: asv keeps a history only across results of one version. Bump it when
# what a number means changes (a case's shape, its byte count, the timing method), not when
# the code that measures it moves.
ASV_VERSION = "1"


def asv_results(*, warmup: int = 10, reps: int = 100, quick: bool = False) -> dict:
    """Everything one asv ``setup_cache`` measures: ``{"skip": reason}`` with no GPU, else the
    ceilings, the device and the result record of every case, array API and PyTorch path.

    With ``CUKERN_BENCH_JSON=array.json:torch.json`` (the ``--json`` files of ``python -m cukern
    bench`` and ``bench --torch`` run for the same commit on the same machine) the figures of
    that run are recorded instead of being measured again (``array.json`` alone, or a ``--filter``
    run: the cases it lacks are skipped)."""
    import json
    import os

    saved = os.environ.get("CUKERN_BENCH_JSON")
    if saved:
        files = saved.split(":")
        array = json.loads(open(files[0]).read())
        path = json.loads(open(files[1]).read()) if len(files) > 1 else {"results": []}
        return {"skip": None, "device": array["device"], "versions": array["versions"],
                "copy_gbps": array["copy_gbps"], "matmul_tflops": array["matmul_tflops"],
                "cases": {r["name"]: r for r in array["results"]},
                "torch_cases": {r["name"]: r for r in path["results"]}}
    reason = unavailable_reason()
    if reason:
        return {"skip": reason}
    array, path = cases(quick), torch_cases(quick)
    copy = copy_bandwidth()
    mm = matmul_rate() if any(c.flops is not None for c in array + path) else None
    results = run_cases(array, warmup=warmup, reps=reps, copy_gbps=copy, matmul_tflops=mm)
    torch_results = run_torch_cases(path, warmup=warmup, reps=reps, copy_gbps=copy, matmul_tflops=mm)
    return {"skip": None, "device": device_info(), "versions": versions(), "copy_gbps": copy,
            "matmul_tflops": mm, "cases": {r["name"]: r for r in results},
            "torch_cases": {r["name"]: r for r in torch_results}}


def _metric(name: str, unit: str, pretty: str, read: Callable[[dict], Any]) -> Callable:
    """An asv ``track_`` benchmark named ``name`` (module.function, as asv lists it) reading its
    number from the measured dict; skipped (its setup raises NotImplementedError, asv's way)
    where there is no GPU or the number was not measured (no Liger installed, say)."""
    def setup(measured):
        if measured.get("skip"):
            raise NotImplementedError(measured["skip"])
        if read(measured) is None:
            raise NotImplementedError(f"{name}: not measured here")

    def track(measured):
        return read(measured)

    track.setup = setup
    track.benchmark_name = name
    track.__name__ = track.__qualname__ = "track__" + name.replace(".", "__")
    track.unit = unit
    track.timeout = ASV_TIMEOUT
    track.version = ASV_VERSION
    track.pretty_name = pretty
    return track


def _case_value(group: str, case_name: str, key: str):
    def read(measured):
        r = measured[group].get(case_name)
        if r is None:   # (a run of some cases, ``bench --filter``: the others were not measured)
            return None
        if r.get("error"):
            raise RuntimeError(f"{case_name}: {r['error']}")
        return r.get(key)
    return read


def asv_benchmarks(namespace: dict) -> None:
    """Fill the asv module's namespace with a ``track_`` benchmark for every number of every
    family: array-API cases as ``bench_<family>.track_<case>_{gbps|tflops|speedup}`` (and
    ``bench_<family>.track_copy_gbps``, the ceiling), PyTorch-path cases as
    ``bench_torch_<family>.track_<case>_{vs_eager|vs_compile|vs_liger|over_array|host_us|peak_mib}``.
    Everything is measured once, in the module's ``setup_cache`` (``asv_results()``), which
    every benchmark reads; without a GPU ``setup`` skips them all."""
    from ._registry import families

    def setup(measured):
        if measured.get("skip"):
            raise NotImplementedError(measured["skip"])

    namespace["setup_cache"].timeout = ASV_TIMEOUT
    namespace.update(timeout=ASV_TIMEOUT, setup=setup)
    tracks = []
    for fam in families():
        array, path = cases(family=fam.name), torch_cases(family=fam.name)
        if array:
            tracks.append(_metric(f"bench_{fam.name}.track_copy_gbps", "GB/s",
                                  f"{fam.name}: device-to-device copy bandwidth (the ceiling)",
                                  lambda m: m["copy_gbps"]))
        for c in array:
            rate = "tflops" if c.flops else "gbps"
            label = f"{fam.name}: {c.name} ({c.shape_label} {c.dtype})"
            tracks.append(_metric(f"bench_{fam.name}.track_{slug(c.name)}_{rate}", "TFLOP/s" if c.flops else "GB/s",
                                  f"{label}, {rate}", _case_value("cases", c.name, rate)))
            tracks.append(_metric(f"bench_{fam.name}.track_{slug(c.name)}_speedup", "x", f"{label}, speedup",
                                  _case_value("cases", c.name, "speedup")))
        for c in path:
            label = f"{fam.name} via cukern.torch: {c.name} ({c.shape_label} {c.dtype})"
            for key, unit, what in (("vs_eager", "x", "speed-up over PyTorch eager"),
                                    ("vs_compile", "x", "speed-up over torch.compile"),
                                    ("vs_liger", "x", "speed-up over Liger-Kernel"),
                                    ("torch_over_array", "x", "time over the array API's"),
                                    ("host_us", "us", "host time a call"),
                                    ("peak_mib", "MiB", "peak memory a call beyond its inputs")):
                if key == "vs_liger" and c.liger is None:   # (no Liger peer for this case)
                    continue
                read = _case_value("torch_cases", c.name, key)
                if key in ("host_us", "peak_mib"):
                    read = (lambda inner: lambda m: (inner(m) or {}).get("cukern.torch"))(read)
                tracks.append(_metric(f"bench_torch_{fam.name}.track_{slug(c.name)}_{key}", unit,
                                      f"{label}, {what}", read))
    for t in tracks:
        namespace[t.__name__] = t
