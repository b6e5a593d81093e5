"""Running the cases the families declare: the array API against PyTorch, and the PyTorch path
(``cukern.torch`` against eager, torch.compile and Liger)."""
from __future__ import annotations

import math
import re
from typing import Callable, Sequence

from .._bench_cases import Case, TorchCase
from .environment import fa4_version, liger_version, quack_version
from .results import AGREE, error_result, gbps, input_set_count, summarize, tflops
from .timing import copy_bandwidth, host_us, l2_bytes, matmul_rate, time_cuda_detail, time_cuda_interleaved

# ---- cases ----------------------------------------------------------------------------------

def slug(name: str) -> str:
    """A case name as an identifier: ``"layer_norm fwd+bwd"`` -> ``"layer_norm_fwd_bwd"``."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")


def cases(quick: bool = False, family: str | None = None) -> list[Case]:
    """Every array-API case of every family, in table order; ``quick`` takes smaller shapes."""
    from .._registry import families

    return [c for f in families() if f.bench and family in (None, f.name) for c in f.bench(quick)]


def torch_cases(quick: bool = False, family: str | None = None) -> list[TorchCase]:
    """Every PyTorch-path case of every family (``bench --torch``)."""
    from .._registry import families

    return [c for f in families() if f.torch_bench and family in (None, f.name) for c in f.torch_bench(quick)]

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
    err = relative_error(case.cukern_fn(sets[0]), case.torch_fn(sets[0])) if case.compares else None
    torch.cuda.synchronize()
    tc, tt = time_cuda_interleaved([case.cukern_fn, case.torch_fn], warmup=warmup, reps=reps, input_sets=sets)
    r = summarize(case, tc.median_ms, tt.median_ms, copy_gbps=copy_gbps, matmul_tflops=matmul_tflops)
    r.update(rel_err=err, agrees=err is None or bool(err <= AGREE.get(case.dtype, 2e-2)), input_sets=nsets,
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

TORCH_IMPLS = ("array", "cukern.torch", "eager", "compile", "liger", "fa4", "quack")
PEERS = ("liger", "fa4", "quack")   # other libraries' implementations: optional, and left out where they fail

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


def first_calls(impls: dict[str, Callable], inputs, compare: bool = True) -> tuple[dict, dict]:
    """Each implementation's first call on ``inputs``: (relative error against "eager"'s output
    by name, none where not ``compare``; the error of each peer library that raised). A peer
    that raises (another library's first call: its autotuning, a dtype or layout it refuses) is
    removed from ``impls``, costing its column rather than the row; cukern's and PyTorch's own
    raise."""
    expect = impls["eager"](inputs)
    errors, peer_errors = {}, {}
    for name, fn in list(impls.items()):
        if name == "eager":
            continue
        try:
            out = fn(inputs)
            if compare:
                errors[name] = relative_error(out, expect)
        except Exception as e:   # noqa: BLE001 - another library's failure costs its column, not the row
            if name not in PEERS:
                raise
            peer_errors[name] = f"{type(e).__name__}: {e}"[:300]
            del impls[name]
    return errors, peer_errors


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
    if case.fa4 is not None and fa4_version() is not None:
        impls["fa4"] = _step(case, case.fa4)
    if case.quack is not None and quack_version() is not None:
        impls["quack"] = _step(case, case.quack)
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
    errors, peer_errors = first_calls(impls, sets[0], case.compares)
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
         "input_sets": nsets, "reps": reps, "peer_errors": peer_errors, "quack": case.quack is not None,
         "library": "fa4" if case.fa4 is not None else "liger" if case.liger is not None else None}
    mine = ms["cukern.torch"]
    r["torch_over_array"] = mine / ms["array"] if ms["array"] > 0 else None
    for peer in ("eager", "compile", *PEERS):
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
