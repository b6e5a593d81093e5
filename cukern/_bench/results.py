"""A case's figures (GB/s, TFLOP/s, ratios to the ceilings and to PyTorch) and the tables that
show them."""
from __future__ import annotations

from .._bench_cases import SHORT_DTYPE, Case

# Rotate among input sets until one round touches at least this many times the L2 size.
L2_FACTOR = 4
MAX_INPUT_SETS = 16

# Largest relative L2 difference from torch's outputs still reported as agreeing (per dtype;
# both sides round their outputs to the dtype).
AGREE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}

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

# The peer library of a PyTorch-path row (Liger-Kernel, FlashAttention-4): its key and its label.
LIBRARIES = {"liger": "Liger", "fa4": "FA4", "quack": "quack"}


def _library(r: dict) -> str:
    """The key of the row's peer library (the record says it; older records had Liger alone)."""
    return r.get("library") or "liger"


def _peaks(peak: dict | None, library: str = "liger") -> str:
    if not peak:
        return "-"
    return " / ".join("-" if peak.get(k) is None else f"{peak[k]:.0f}" for k in ("cukern.torch", "eager", library))


def format_torch_table(results: list[dict]) -> str:
    """The PyTorch-path results: median ms of each implementation (the bench's method), the
    ratios, the isolated call's time and the host time a call."""
    head = ("case", "shape", "array ms", "cukern.torch ms", "/array", "eager ms", "compile ms", "library ms",
            "vs eager", "vs compile", "vs library", "quack ms", "vs quack", "isolated ms (ct/eager)",
            "host us (ct/eager/array)", "peak MiB (ct/eager/library)")
    rows = []

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in results:
        shape = "x".join(str(n) for n in r["shape"]) + " " + SHORT_DTYPE.get(r["dtype"], r["dtype"])
        if r.get("error"):
            rows.append((r["name"], shape, "error") + ("",) * (len(head) - 3))
            continue
        ms, iso, host = r["ms"], r["isolated_ms"], r["host_us"]
        lib = _library(r)
        lib_ms, vs_lib = ms.get(lib), r.get(f"vs_{lib}")
        label = f" {LIBRARIES[lib]}"
        rows.append((r["name"] + (" (fell back!)" if r["routed"] is False else ""), shape, f(ms["array"], ".3f"),
                     f(ms["cukern.torch"], ".3f"), f(r["torch_over_array"], ".2f"), f(ms["eager"], ".3f"),
                     f(ms["compile"], ".3f"), f(lib_ms, ".3f") + (label if lib_ms is not None else ""),
                     f(r["vs_eager"], ".2f") + "x", f(r["vs_compile"], ".2f") + "x",
                     f(vs_lib, ".2f") + ("x" + label if vs_lib else ""),
                     f(ms.get("quack"), ".3f"), f(r.get("vs_quack"), ".2f") + ("x" if r.get("vs_quack") else ""),
                     f"{iso['cukern.torch']:.3f} / {iso['eager']:.3f}",
                     f"{host['cukern.torch']:.0f} / {host['eager']:.0f} / {host['array']:.0f}",
                     _peaks(r.get("peak_mib"), lib)))
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
        failed = r.get("peer_errors") or {}
        for key, err in failed.items():
            notes.append(f"! {r['name']}: {LIBRARIES[key]} failed on its first call, not timed: {err}")
        if r.get("library") and r["library"] not in r["ms"] and r["library"] not in failed:
            notes.append(f"! {r['name']}: {LIBRARIES[r['library']]} does not import here: not timed")
        if r.get("quack") and "quack" not in r["ms"] and "quack" not in failed:
            notes.append(f"! {r['name']}: quack does not import here: not timed")
    return "\n".join(out + ([""] + notes if notes else []))
