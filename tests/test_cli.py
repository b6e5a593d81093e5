"""``python -m cukern`` and the pure parts of the benchmark mechanism (no GPU needed)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import importlib

from cukern import _bench, _bench_cases

NORM = importlib.import_module("cukern.norm")
GROUP_NORM = importlib.import_module("cukern.group_norm")   # (cukern.group_norm is the function)

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "cukern", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


class Ran:
    """What a command run in this process returned and printed (as a CompletedProcess has it)."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capsys):
    """Run ``python -m cukern ARGS`` in this process (the interpreter's start and torch's import
    are paid once for the file, not once a command: a subprocess each cost seconds)."""
    from cukern.__main__ import main

    def run(*args: str) -> Ran:
        capsys.readouterr()
        try:
            rc = main(list(args))
        except SystemExit as e:   # (argparse's refusals)
            rc = e.code
        except Exception as e:  # noqa: BLE001 - reported as a traceback would be
            import traceback
            rc = 1
            print("Traceback\n" + "".join(traceback.format_exception(e)), file=sys.stderr)
        out, err = capsys.readouterr()
        return Ran(rc, out, err)
    return run


@functools.lru_cache(maxsize=None)
def gpu_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - not installed, no driver, no device
        return False


# ---- the command line -------------------------------------------------------------------------

def test_help():
    with ThreadPoolExecutor(2) as pool:   # (both processes at once: each is mostly an interpreter starting)
        top, bench = pool.map(lambda args: run_cli(*args), (("--help",), ("bench", "--help")))
    assert top.returncode == 0, top.stderr
    assert "info" in top.stdout and "bench" in top.stdout
    assert bench.returncode == 0, bench.stderr
    for option in ("--quick", "--filter", "--json"):
        assert option in bench.stdout


def _subparsers():
    from cukern.__main__ import parser

    top = parser()
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return top, sub


def test_every_option_has_help_text_with_its_default():
    top, sub = _subparsers()
    for name, p in sub.choices.items():
        text = p.format_help()
        for action in p._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
                continue
            assert action.help, f"{name} {action.option_strings}: no help text"
            line = p._get_formatter()._get_help_string(action)
            assert "default" in line, f"{name} {action.option_strings}: the help does not give the default"
            assert action.option_strings[0] in text


def test_the_gpu_commands_say_so_alike():
    top, sub = _subparsers()
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name in ("bench", "train-demo", "profile"):
        assert helps[name].endswith("(needs a CUDA GPU)"), helps[name]
        assert sub.choices[name].description.rstrip(".").endswith("(needs a CUDA GPU)")
    assert "no GPU needed" in helps["info"]


def test_the_gpu_commands_refuse_alike_without_a_gpu(cli):
    if gpu_present():
        pytest.skip("a GPU is present")
    hints = set()
    for args in (("bench", "--quick"), ("train-demo", "--steps", "1"), ("profile", "--steps", "1")):
        p = cli(*args)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        lines = p.stderr.strip().splitlines()
        assert lines[0].startswith(f"cukern {args[0]}: cannot run here: ")
        hints.add(lines[-1].replace(args[0], "COMMAND"))
    assert len(hints) == 1, hints
    assert "python -m cukern info" in hints.pop()


def test_warmup_without_a_gpu_says_where_the_kernels_compile(cli):
    pytest.importorskip("torch")
    if gpu_present():
        pytest.skip("a GPU is present (the GPU test runs warmup whole)")
    p = cli("warmup", "--no-native", "--model", "llama", "--seq", "64")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stdout == "" and "kernels: not compiled here" in p.stderr and "where the GPU is" in p.stderr
    p = cli("warmup", "--no-native")
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p.stderr


@pytest.mark.gpu
def test_warmup_compiles_a_models_kernels_into_the_caches(tmp_path):
    pytest.importorskip("transformers")
    if not gpu_present():
        pytest.skip("needs a GPU")
    p = run_cli("warmup", "--model", "llama", "--dim", "256", "--heads", "4", "--seq", "256", "--batch", "2",
                timeout=600)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("cukern warmup: C++ extension: built") and "kernels: llama" in lines[1], p.stdout
    assert int(lines[1].split(" ran ")[1].split()[0]) > 5


def test_info(cli):
    p = cli("info")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert any(line.startswith("NVRTC:") for line in lines), p.stdout
    assert any(line.startswith("GPU") for line in lines), p.stdout
    assert any(line.startswith("kernel cache:") for line in lines), p.stdout
    assert any(line.startswith("CUDA sources:") for line in lines), p.stdout


def test_bench_without_gpu_fails_cleanly(cli):
    if gpu_present():
        pytest.skip("a GPU is present: bench would run")
    p = cli("bench", "--quick")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stdout + p.stderr
    assert "cannot run here" in p.stderr
    assert "no CUDA GPU" in p.stderr or "not installed" in p.stderr or "without CUDA" in p.stderr


def test_bench_list_needs_no_gpu(cli):
    p = cli("bench", "--list", "--filter", "rms")
    assert p.returncode == 0, p.stderr
    names = [line.split("  ")[0].strip() for line in p.stdout.splitlines()]
    assert names == [c.name for c in _bench.cases() if "rms" in c.name]


def test_bench_filter_matching_nothing(cli):
    p = cli("bench", "--filter", "no-such-case")
    assert p.returncode == 2
    assert "no case matches" in p.stderr and "Traceback" not in p.stderr


def test_bench_rejects_bad_reps(cli):
    p = cli("bench", "--reps", "0")
    assert p.returncode == 2 and "positive integer" in p.stderr


def test_import_cukern_imports_neither_torch_nor_cupy():
    code = ("import sys, cukern, cukern._bench, cukern.__main__; "
            "print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


# ---- the case table and the arithmetic ---------------------------------------------------------

def test_norm_cases_bytes():
    (n, d), dt = NORM.WORKLOAD["full"], NORM.WORKLOAD["dtype"]
    assert (n, d, dt) == (65536, 4096, "bfloat16")
    by_name = {c.name: c for c in _bench.cases()}
    passes = {"layer_norm fwd": 2, "rms_norm fwd": 2, "layer_norm fwd+bwd": 5,
              "rms_norm fwd+bwd": 5, "layer_norm +residual fwd": 4, "rms_norm +residual fwd": 4}
    assert set(passes) <= set(by_name)
    for name, k in passes.items():
        c = by_name[name]
        assert (c.family, c.shape, c.dtype, c.flops) == ("norm", (n, d), dt, None)
        assert c.nbytes == k * n * d * 2


def test_group_norm_cases_bytes():
    w = GROUP_NORM.WORKLOAD
    assert (w["full"], w["groups"], w["dtype"]) == ((16, 512, 64, 64), 32, "bfloat16")
    by_name = {c.name: c for c in _bench.cases(family="group_norm")}
    passes = {"group_norm fwd": 2, "group_norm fwd+bwd": 5, "group_norm channels_last fwd": 2,
              "group_norm channels_last fwd+bwd": 5}
    assert set(passes) == set(by_name)
    for name, k in passes.items():
        assert by_name[name].nbytes == k * 16 * 512 * 64 * 64 * 2


def test_cases_quick_and_family():
    quick = _bench.cases(quick=True)
    full = _bench.cases()
    assert [c.name for c in quick] == [c.name for c in full]
    assert all(q.nbytes < f.nbytes for q, f in zip(quick, full))
    assert quick[0].shape == NORM.WORKLOAD["quick"]
    assert {c.family for c in _bench.cases(family="norm")} == {"norm"}
    assert _bench.cases(family="no-such-family") == []
    names = [c.name for c in full]
    assert len(set(names)) == len(names)
    slugs = [_bench.slug(n) for n in names]
    assert len(set(slugs)) == len(slugs) and all(s.isidentifier() for s in slugs)


def test_slug():
    assert _bench.slug("layer_norm fwd+bwd") == "layer_norm_fwd_bwd"
    assert _bench.slug("rms_norm +residual fwd") == "rms_norm_residual_fwd"


def test_rates():
    assert _bench.gbps(2 * 10**9, 1000.0) == pytest.approx(2.0)
    assert _bench.gbps(10**9, 0.5) == pytest.approx(2000.0)
    assert _bench.tflops(10**12, 2.0) == pytest.approx(500.0)
    assert _bench_cases.elements_bytes((65536, 4096), "bfloat16", 5) == 5 * 65536 * 4096 * 2
    assert _bench_cases.elements_bytes((3, 5), "float32") == 60


def test_input_set_count():
    l2 = 50 * 2**20
    assert _bench.input_set_count(2 * 2**30, l2) == 1          # far larger than L2
    assert _bench.input_set_count(4 * l2, l2) == 1
    assert _bench.input_set_count(4 * l2 - 1, l2) == 2
    assert _bench.input_set_count(l2, l2) == 4
    assert _bench.input_set_count(1, l2) == _bench.MAX_INPUT_SETS
    assert _bench.input_set_count(0, l2) == 1


def _case(flops=None):
    return _bench.Case("toy op", "toy", (1000, 1000), "bfloat16", 4 * 10**9, lambda s: {},
                       lambda t: None, lambda t: None, flops=flops)


def test_summarize_memory_bound():
    r = _bench.summarize(_case(), 2.0, 3.0, copy_gbps=4000.0)
    assert r["gbps"] == pytest.approx(2000.0)
    assert r["torch_gbps"] == pytest.approx(4e9 / 3e-3 / 1e9)
    assert r["pct_of_copy"] == pytest.approx(50.0)
    assert r["speedup"] == pytest.approx(1.5)
    assert r["tflops"] is None and r["pct_of_matmul"] is None
    assert r["shape"] == [1000, 1000] and r["bytes"] == 4 * 10**9
    assert _bench.summarize(_case(), 2.0, 3.0)["pct_of_copy"] is None


def test_summarize_flop_bound():
    r = _bench.summarize(_case(flops=10**12), 2.0, 1.0, matmul_tflops=1000.0)
    assert r["tflops"] == pytest.approx(500.0)
    assert r["pct_of_matmul"] == pytest.approx(50.0)
    assert r["gbps"] is None and r["pct_of_copy"] is None
    assert r["speedup"] == pytest.approx(0.5)


def test_format_table():
    ok = _bench.summarize(_case(), 2.0, 3.0, copy_gbps=4000.0)
    ok.update(rel_err=1e-3, agrees=True)
    fl = _bench.summarize(_case(flops=10**12), 2.0, 1.0, matmul_tflops=1000.0)
    bad = dict(_bench.summarize(_case(), 1.0, 1.0), name="wrong op", rel_err=0.5, agrees=False)
    err = _bench.error_result(_case(), "CompileError: nope")
    text = _bench.format_table([ok, fl, bad, err])
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["case", "shape"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    row = lines[2]
    for cell in ("toy op", "1000x1000 bf16", "2.000", "3.000", "2000 GB/s", "50.0% copy", "1.50x"):
        assert cell in row
    assert "500 TFLOP/s" in lines[3] and "50.0% matmul" in lines[3] and "0.50x" in lines[3]
    assert "error" in lines[5]
    assert any(line.startswith("! wrong op") and "differ" in line for line in lines)
    assert any(line.startswith("! toy op: CompileError: nope") for line in lines)
    # the columns line up
    assert len({len(line) for line in lines[:2]}) == 1


def test_unavailable_reason_without_gpu():
    if gpu_present():
        pytest.skip("a GPU is present")
    reason = _bench.unavailable_reason()
    assert reason and isinstance(reason, str)


def test_asv_results_skips_without_gpu():
    if gpu_present():
        pytest.skip("a GPU is present")
    out = _bench.asv_results()
    assert out["skip"]


def test_torch_cases_are_discovered_from_the_families():
    from cukern import _registry

    names = [c.name for c in _bench.torch_cases()]
    assert len(set(names)) == len(names)
    assert {c.family for c in _bench.torch_cases()} == set(_registry.FAMILIES)
    assert all(c.nbytes > 0 for c in _bench.torch_cases(quick=True))


def _asv_module():
    if not (ROOT / "asv_bench" / "benchmarks" / "bench_cukern.py").is_file():
        pytest.skip("asv_bench/ is not in this copy (an sdist)")
    sys.path.insert(0, str(ROOT / "asv_bench"))
    try:
        from benchmarks import bench_cukern
    finally:
        sys.path.remove(str(ROOT / "asv_bench"))
    return bench_cukern


def test_asv_benchmarks_cover_every_case_under_their_historic_names():
    """One asv module discovers every family's cases; each benchmark keeps its name
    (bench_<family>.track_...) and carries the explicit version its history is kept under."""
    mod = _asv_module()
    tracks = {getattr(mod, n).benchmark_name: getattr(mod, n) for n in dir(mod) if n.startswith("track_")}
    for c in _bench.cases():
        what = "tflops" if c.flops else "gbps"
        for key, unit in ((what, "TFLOP/s" if c.flops else "GB/s"), ("speedup", "x")):
            fn = tracks[f"bench_{c.family}.track_{_bench.slug(c.name)}_{key}"]
            assert fn.unit == unit and fn.timeout >= 600 and fn.version == _bench.ASV_VERSION
    for c in _bench.torch_cases():
        for key in ("vs_eager", "vs_compile", "torch_over_array", "host_us", "peak_mib") + (
                ("vs_liger",) if c.liger else ()) + (("vs_fa4",) if c.fa4 else ()) + (("vs_quack",) if c.quack else ()):
            assert f"bench_torch_{c.family}.track_{_bench.slug(c.name)}_{key}" in tracks
        for key, peer in (("vs_liger", c.liger), ("vs_fa4", c.fa4), ("vs_quack", c.quack)):
            if not peer:
                assert f"bench_torch_{c.family}.track_{_bench.slug(c.name)}_{key}" not in tracks
    fake = {"skip": None, "copy_gbps": 3000.0,
            "cases": {c.name: _bench.summarize(c, 0.5, 1.0, copy_gbps=3000.0) for c in _bench.cases()},
            "torch_cases": {c.name: {"vs_eager": 1.5, "vs_liger": None, "host_us": {"cukern.torch": 20.0},
                                     "peak_mib": {"cukern.torch": 512.0, "eager": 2048.0}}
                            for c in _bench.torch_cases()}}
    assert tracks["bench_norm.track_layer_norm_fwd_speedup"](fake) == pytest.approx(2.0)
    expect = _bench.gbps(5 * 65536 * 4096 * 2, 0.5)
    assert tracks["bench_norm.track_rms_norm_fwd_bwd_gbps"](fake) == pytest.approx(expect)
    assert tracks["bench_torch_norm.track_layer_norm_fwd_bwd_vs_eager"](fake) == 1.5
    assert tracks["bench_torch_norm.track_layer_norm_fwd_bwd_host_us"](fake) == 20.0
    assert tracks["bench_torch_cross_entropy.track_linear_cross_entropy_fwd_bwd_peak_mib"](fake) == 512.0
    with pytest.raises(NotImplementedError):   # Liger not installed: not measured, skipped
        tracks["bench_torch_norm.track_layer_norm_fwd_bwd_vs_liger"].setup(fake)
    tracks["bench_torch_norm.track_layer_norm_fwd_bwd_vs_eager"].setup(fake)   # measured: runs
    with pytest.raises(NotImplementedError):
        mod.setup({"skip": "no GPU"})
    assert tracks["bench_norm.track_copy_gbps"](fake) == 3000.0
    # a recorded run of some cases (bench --filter attention, no --torch run): the others skip
    part = {"skip": None, "copy_gbps": 3000.0, "torch_cases": {},
            "cases": {n: r for n, r in fake["cases"].items() if n.startswith("attention")}}
    tracks["bench_attention.track_attention_d128_fwd_vs_cudnn_speedup"].setup(part)
    assert tracks["bench_attention.track_attention_d128_fwd_vs_cudnn_speedup"](part) == pytest.approx(2.0)
    for name in ("bench_norm.track_layer_norm_fwd_speedup", "bench_torch_norm.track_layer_norm_fwd_bwd_vs_eager"):
        with pytest.raises(NotImplementedError):
            tracks[name].setup(part)


class _FakeEvent:
    """A stand-in for torch.cuda.Event that reads the host clock (for the control flow only)."""
    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = self.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.t - self.t


@pytest.fixture
def fake_events(monkeypatch):
    """torch.cuda's events, synchronize and sleep replaced by _FakeEvent's host-side clock."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(_bench.timing, "_sleep_cycles_per_ms", 1e6)


def test_time_cuda_rotates_sets_and_takes_the_median(fake_events):
    seen = []

    def fn(s):
        seen.append(s)
        _FakeEvent.clock[0] += {"a": 1.0, "b": 3.0, "c": 2.0}[s]

    t = _bench.time_cuda_detail(fn, warmup=4, reps=9, input_sets=["a", "b", "c"])
    assert len(seen) == 1 + 4 + 9
    assert seen[:6] == ["a", "b", "c", "a", "b", "c"]
    assert len(t.samples_ms) == 9 and sorted(t.samples_ms) == [1.0] * 3 + [2.0] * 3 + [3.0] * 3
    assert t.median_ms == 2.0 and t.host_ms >= 0
    calls = []
    assert _bench.time_cuda(lambda: calls.append(1), warmup=2, reps=5) == 0.0
    assert len(calls) == 1 + 2 + 5


def test_time_cuda_interleaved_alternates_blocks_and_rotates_the_first(fake_events):
    """Each function gets its warm-up and then ``reps`` timed calls in ``rounds`` blocks taken in
    turn, the first of a round rotating; the input sets keep rotating across the blocks."""
    log = []

    def make(name, cost):
        def fn(s):
            log.append((name, s))
            _FakeEvent.clock[0] += cost + {"a": 0.0, "b": 0.5}[s]
        return fn

    a, b = _bench.time_cuda_interleaved([make("x", 1.0), make("y", 4.0)], warmup=2, reps=10,
                                        input_sets=["a", "b"], rounds=3)
    assert log[:6] == [("x", "a"), ("x", "b"), ("x", "a"), ("y", "a"), ("y", "b"), ("y", "a")]
    # (rounds of 4, 3 and 3 calls: x then y, y then x, x then y)
    assert [n for n, _ in log[6:]] == ["x"] * 4 + ["y"] * 4 + ["y"] * 3 + ["x"] * 3 + ["x"] * 3 + ["y"] * 3
    assert [s for n, s in log[6:] if n == "x"] == ["b", "a"] * 5   # (call 3 on, as one run would)
    assert len(a.samples_ms) == len(b.samples_ms) == 10
    assert a.median_ms == 1.25 and b.median_ms == 4.25 and a.host_ms >= 0


def test_time_cuda_interleaved_holds_every_block_as_long_as_the_slowest_host_needs(fake_events, monkeypatch):
    """The hold before a block idles the device; one side held longer would start its blocks
    cooler (a higher clock under the power cap), so all take the longest host time's hold."""
    holds = []
    monkeypatch.setattr(_bench.timing, "_hold_device", holds.append)
    host = iter([0.02, 0.05])   # ms a call: the two functions' warm-up
    monkeypatch.setattr(_bench.timing, "_warm", lambda call, warmup: next(host))
    a, b = _bench.time_cuda_interleaved([lambda: None, lambda: None], warmup=2, reps=8, rounds=2)
    assert holds == [1.0 + 1.25 * 0.05 * 4] * 4
    assert (a.host_ms, b.host_ms) == (0.02, 0.05)   # (each side's own host time is still reported)


def test_each_case_runs_in_order_and_an_error_is_recorded_not_raised(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(_bench.run, "l2_bytes", lambda device=0: 1)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    seen = []

    def run_one(case, l2, **kw):
        seen.append((case.name, l2, kw))
        if case.name == "bad":
            raise ValueError("boom")
        return {"name": case.name}

    cases = [_case(), dataclasses.replace(_case(), name="bad"), _case()]
    progress = []
    out = _bench.run._run_each(run_one, cases, lambda i, n, c: progress.append((i, n)), reps=3)
    assert [r["name"] for r in out] == ["toy op", "bad", "toy op"] and out[1]["error"] == "ValueError: boom"
    assert seen[0] == ("toy op", 1, {"reps": 3}) and progress == [(1, 3), (2, 3), (3, 3)]


def test_the_torch_table_shows_peak_memory_and_marks_only_real_fallbacks():
    rec = {"name": "x fwd+bwd", "shape": [4, 8], "dtype": "bfloat16", "routed": None, "error": None,
           "ms": {"array": 1.0, "cukern.torch": 1.0, "eager": 2.0, "compile": 1.5},
           "isolated_ms": {"cukern.torch": 1.1, "eager": 2.1}, "host_us": {"cukern.torch": 30, "eager": 10, "array": 9},
           "peak_mib": {"cukern.torch": 125.4, "eager": 22900.0}, "torch_over_array": 1.0, "vs_eager": 2.0,
           "vs_compile": 1.5, "vs_liger": None, "rel_err": {}}
    table = _bench.format_torch_table([rec])
    assert "peak MiB (ct/eager/library)" in table and "125 / 22900 / -" in table and "fell back" not in table
    assert "(fell back!)" in _bench.format_torch_table([{**rec, "routed": False}])
    assert "  -" in _bench.format_torch_table([{k: v for k, v in rec.items() if k != "peak_mib"}])


def test_the_torch_table_names_each_rows_peer_library_and_says_when_it_is_missing():
    rec = {"name": "sdpa causal d128 fwd+bwd", "shape": [4, 8], "dtype": "bfloat16", "routed": True, "error": None,
           "ms": {"array": 1.0, "cukern.torch": 1.0, "eager": 2.0, "compile": 1.5, "fa4": 0.9},
           "isolated_ms": {"cukern.torch": 1.1, "eager": 2.1}, "host_us": {"cukern.torch": 30, "eager": 10, "array": 9},
           "peak_mib": {"cukern.torch": 100.0, "eager": 300.0, "fa4": 90.0}, "torch_over_array": 1.0,
           "vs_eager": 2.0, "vs_compile": 1.5, "vs_liger": None, "vs_fa4": 0.9, "rel_err": {}, "library": "fa4"}
    table = _bench.format_torch_table([rec])
    assert "0.900 FA4" in table and "0.90x FA4" in table and "100 / 300 / 90" in table and "not timed" not in table
    missing = {**rec, "ms": {k: v for k, v in rec["ms"].items() if k != "fa4"}, "vs_fa4": None}
    assert "! sdpa causal d128 fwd+bwd: FA4 does not import here: not timed" in _bench.format_torch_table([missing])
    liger = {**rec, "library": "liger", "ms": {**missing["ms"], "liger": 1.2}, "vs_liger": 1.2 / 1.0}
    assert "1.200 Liger" in _bench.format_torch_table([liger])


def test_the_torch_table_gives_quack_a_column_and_says_why_a_peer_is_missing():
    rec = {"name": "rms_norm fwd+bwd", "shape": [4, 8], "dtype": "bfloat16", "routed": True, "error": None,
           "ms": {"array": 1.0, "cukern.torch": 1.0, "eager": 2.0, "compile": 1.5, "liger": 1.1, "quack": 1.25},
           "isolated_ms": {"cukern.torch": 1.1, "eager": 2.1}, "host_us": {"cukern.torch": 30, "eager": 10, "array": 9},
           "peak_mib": {"cukern.torch": 100.0, "eager": 300.0, "liger": 90.0}, "torch_over_array": 1.0,
           "vs_eager": 2.0, "vs_compile": 1.5, "vs_liger": 1.1, "vs_quack": 1.25, "rel_err": {}, "library": "liger",
           "quack": True, "peer_errors": {}}
    table = _bench.format_torch_table([rec])
    assert "quack ms" in table and "1.250" in table and "1.25x" in table and "!" not in table
    gone = {**rec, "ms": {k: v for k, v in rec["ms"].items() if k not in ("liger", "quack")}, "vs_liger": None,
            "vs_quack": None, "peer_errors": {"liger": "RuntimeError: out of memory"}}
    table = _bench.format_torch_table([gone])
    assert "! rms_norm fwd+bwd: Liger failed on its first call, not timed: RuntimeError: out of memory" in table
    assert "! rms_norm fwd+bwd: quack does not import here: not timed" in table
    assert "Liger does not import" not in table


def test_a_peer_library_that_raises_costs_its_column_and_cukerns_own_failure_the_row():
    """The first call of every implementation: a peer library's exception is recorded and the
    peer dropped; an exception of cukern's or PyTorch's own implementations propagates."""
    torch = pytest.importorskip("torch")
    from cukern._bench.run import first_calls

    def boom(t):
        raise RuntimeError("autotuning ran out of memory")

    impls = {"eager": lambda t: t * 2, "cukern.torch": lambda t: t * 2, "liger": boom, "quack": lambda t: t * 3}
    errors, failed = first_calls(impls, torch.ones(4))
    assert list(impls) == ["eager", "cukern.torch", "quack"]
    assert errors["cukern.torch"] == 0.0 and errors["quack"] == pytest.approx(0.5)
    assert failed == {"liger": "RuntimeError: autotuning ran out of memory"}
    with pytest.raises(RuntimeError, match="autotuning"):
        first_calls({"eager": lambda t: t, "cukern.torch": boom}, torch.ones(4))
    # (compare=False: every implementation called, a failing peer dropped, no errors computed)
    impls = {"eager": lambda t: t * 2, "cukern.torch": lambda t: t * 5, "liger": boom}
    errors, failed = first_calls(impls, torch.ones(4), compare=False)
    assert errors == {} and list(impls) == ["eager", "cukern.torch"] and list(failed) == ["liger"]


def test_the_norm_and_loss_rows_have_quack_as_a_peer():
    have = {c.name for c in _bench.torch_cases() if c.quack is not None}
    assert have == {"layer_norm fwd+bwd", "rms_norm fwd+bwd", "rms_norm fwd", "cross_entropy fwd+bwd"}


def test_every_attention_torch_case_has_the_fa4_peer():
    """Every attention row but dropout's (FlashAttention-4 takes no dropout), whose outputs are
    not compared (each side draws its own mask)."""
    cases = _bench.torch_cases(family="attention")
    assert cases and all(c.fa4 is not None for c in cases if c.compares)
    assert [c.name for c in cases if not c.compares] == ["sdpa causal d128 dropout 0.1 fwd+bwd"]
    assert all(c.fa4 is None for c in cases if not c.compares)
    assert all(c.fa4 is None for c in _bench.torch_cases() if c.family != "attention")
