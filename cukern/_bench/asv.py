"""The asv suite's side: every case measured once a run (``asv_results``), and the benchmark
functions asv discovers, under their historic names."""
from __future__ import annotations

from typing import Any, Callable

from .environment import device_info, unavailable_reason, versions
from .run import cases, run_cases, run_torch_cases, slug, torch_cases
from .timing import copy_bandwidth, matmul_rate

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
    ``bench_torch_<family>.track_<case>_{vs_eager|vs_compile|vs_liger|vs_fa4|vs_quack|over_array|host_us|peak_mib}``.
    Everything is measured once, in the module's ``setup_cache`` (``asv_results()``), which
    every benchmark reads; without a GPU ``setup`` skips them all."""
    from .._registry import families

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
                                    ("vs_fa4", "x", "speed-up over FlashAttention-4"),
                                    ("vs_quack", "x", "speed-up over quack"),
                                    ("torch_over_array", "x", "time over the array API's"),
                                    ("host_us", "us", "host time a call"),
                                    ("peak_mib", "MiB", "peak memory a call beyond its inputs")):
                if ((key == "vs_liger" and c.liger is None) or (key == "vs_fa4" and c.fa4 is None)
                        or (key == "vs_quack" and c.quack is None)):
                    continue   # (no such peer for this case)
                read = _case_value("torch_cases", c.name, key)
                if key in ("host_us", "peak_mib"):
                    read = (lambda inner: lambda m: (inner(m) or {}).get("cukern.torch"))(read)
                tracks.append(_metric(f"bench_torch_{fam.name}.track_{slug(c.name)}_{key}", unit,
                                      f"{label}, {what}", read))
    for t in tracks:
        namespace[t.__name__] = t
