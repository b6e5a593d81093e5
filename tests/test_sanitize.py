"""tools/sanitize.py and its cases (tests/sanitize_cases.py), on the CPU: every family has cases,
every array function and custom op is run by one, every array case's calls pass the fronts'
checks and the kernels' declared signatures (the dry run), the listing, the parser of
compute-sanitizer's output, and a whole run of the tool with a stand-in for compute-sanitizer."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import cukern
import sanitize_cases as sc
from cukern import _registry

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "sanitize.py"


def _tool():
    spec = importlib.util.spec_from_file_location("sanitize_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sanitize_tool", mod)   # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_every_family_has_cases():
    for f in _registry.families():
        assert f.name in sc.ARRAY_CASES, f"tests/sanitize_cases.py: family {f.name!r} has no cases (ARRAY_CASES)"
        assert [c for c in sc.cases(f.name) if not c.ops], f"tests/sanitize_cases.py: {f.name}'s case list is empty"


def test_every_array_function_is_called_by_some_case():
    for f in _registry.families():
        api = {fn.__name__ for fn in f.api}
        called = {name for c in sc.cases(f.name) for name in c.calls}
        assert not called - api, f"{f.name}: cases declare calls of {sorted(called - api)}, not in the family's api"
        assert not api - called, f"{f.name}: no case of tests/sanitize_cases.py calls {sorted(api - called)}"


def test_case_names_are_unique():
    names = [c.name for f in _registry.families() for c in sc.cases(f.name)]
    dup = sorted({n for n in names if names.count(n) > 1})
    assert not dup, f"cases named alike: {dup}"


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_every_array_case_passes_the_checks_and_calls_what_it_declares(capability, monkeypatch):
    """The dry run: NumPy arrays for device arrays, kernels' arguments packed against their
    declared signatures, plans built and not run. Each case must run through and call exactly
    the array functions it declares."""
    called = []
    for f in _registry.families():
        for fn in f.api:
            def record(*a, _fn=fn, **k):
                called.append(_fn.__name__)
                return _fn(*a, **k)
            monkeypatch.setattr(cukern, fn.__name__, record)
    errors = []
    with sc.dry_run(capability):
        for c in sc.selected():
            if not c.host:
                continue
            called.clear()
            try:
                c.run()
            except Exception as e:  # noqa: BLE001 - collected, all reported at once
                errors.append(f"{c.name}: {type(e).__name__}: {e}")
                continue
            if set(called) != set(c.calls):
                errors.append(f"{c.name}: declares {sorted(c.calls)}, calls {sorted(set(called))}")
    assert not errors, "\n".join(errors)


def test_every_custom_op_has_a_torch_case():
    pytest.importorskip("torch")
    from cukern.torch._ops import OPS

    covered = {op for f in _registry.families() for c in sc.cases(f.name) for op in c.ops}
    assert not set(OPS) - covered, f"custom ops with no case in tests/sanitize_cases.py: {sorted(set(OPS) - covered)}"


def test_every_custom_op_has_an_opcheck_sample():
    """The torch cases run the samples of each op in tests/test_<family>.py's opcheck_samples()
    (read here from its source: the samples make CUDA tensors)."""
    pytest.importorskip("torch")
    missing = []
    for f in _registry.families():
        if not f.torch_ops:
            continue
        fn = getattr(importlib.import_module(f"test_{f.name}"), "opcheck_samples", None)
        source = inspect.getsource(fn) if fn is not None else ""
        missing += [f"{f.name}: {op.name}" for op in f.torch_ops if not re.search(rf"\.{op.name}\.default\b", source)]
    assert not missing, f"custom ops with no sample in opcheck_samples(): {missing}"


def test_retyped_keeps_layouts_and_views():
    torch = pytest.importorskip("torch")
    base = torch.randn(6, 128, requires_grad=True)
    cl = torch.randn(2, 8, 5, 3).to(memory_format=torch.channels_last).requires_grad_(True)
    t = torch.randint(0, 5, (3,))
    gate, up, cl2, t2, s = sc.retyped((base[:, :64], base[:, 64:], cl, t, 1.5), "bfloat16")
    assert gate.dtype == up.dtype == cl2.dtype == torch.bfloat16
    assert gate._base is not None and gate._base is up._base and gate.stride() == (128, 1)
    assert gate.requires_grad and up.requires_grad and cl2.requires_grad and cl2.is_leaf
    assert cl2.stride() == cl.stride() and t2 is t and s == 1.5
    torch.testing.assert_close(up.float(), base[:, 64:].detach().bfloat16().float())
    assert sc.retyped((cl,), "float32")[0] is cl


def test_the_torch_runner_on_a_stand_in_op(monkeypatch):
    """run_torch_op's steps on the CPU, with a stand-in op (x * w, and a statistic): each sample
    in the dtype asked, three calls (eager twice, the custom op), each backward three times
    (3, 3 with the graph retained, then 1) and once under no_grad."""
    torch = pytest.importorskip("torch")
    from cukern.torch._ops import OPS

    seen = []

    class Stand:
        visible = 1
        _opname = "stand_in"

        def __call__(self, x, w, flag):
            seen.append((x.dtype, torch.is_grad_enabled(), flag))
            y = x * w
            return y, y.detach().float().sum(-1)

    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, requires_grad=True)
    monkeypatch.setitem(OPS, "stand_in", Stand())
    monkeypatch.setattr(sc, "opcheck_samples", lambda family: [(Stand(), (x, w, True))])
    sc.run_torch_op("norm", "stand_in", "float16")
    assert seen == [(torch.float16, True, True), (torch.float16, False, True)] * 3
    assert x.grad is None   # (the op ran on float16 copies)
    with pytest.raises(LookupError, match="no sample of torch.ops.cukern.layer_norm"):
        sc.run_torch_op("norm", "layer_norm", "float32")


def test_list_runs_without_a_gpu():
    # (both processes at once: each is mostly an interpreter starting and importing)
    every, rope = (subprocess.Popen([sys.executable, str(TOOL), "--list", *extra], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT)
                   for extra in ([], ["--family", "rope"]))
    out, err = every.communicate(timeout=300)
    assert every.returncode == 0, err
    for f in _registry.families():
        assert re.search(rf"^{f.name}: \d+ cases", out, re.M), f"--list: no line for {f.name}"
        assert f"  {f.name}/" in out
    assert "CUKERN_ATTENTION_SM80=1" in out
    out, err = rope.communicate(timeout=300)
    assert rope.returncode == 0 and "rope/" in out and "norm/" not in out


LOG = """\
# compute-sanitizer --tool memcheck ...
========= COMPUTE-SANITIZER
[sanitize] 3 cases (default process, shard 0/1)
[sanitize] device NVIDIA H200, sm_90
[sanitize] case 1/3 norm/layer_norm/float32/5x7/weight+bias
[sanitize] case 2/3 norm/rms_norm/float16/6x64/llama/weight+offset=1.0
========= Invalid __global__ read of size 16 bytes
=========     at void norm_fwd<float, (bool)0, (int)4>(const float *, long long)+0x1b0 in norm.cu:120
=========     by thread (3,0,0) in block (0,0,0)
=========     Address 0x7f3a00000200 is out of bounds
=========
========= Warning: Device backtrace not available
[sanitize] case 3/3 rope/float32/B2 Hq4 Hk2 S67 D64/bhsd
[sanitize] FAILED rope/float32/B2 Hq4 Hk2 S67 D64/bhsd: RuntimeError: CUDA error: unspecified launch failure
[sanitize] slowest: a 1.0 s
[sanitize] done 3 cases, 1 failed, 0 kernels compiled, 3.2 s
========= ERROR SUMMARY: 14976 errors
"""


def test_the_summary_parser_reads_compute_sanitizers_lines():
    tool = _tool()
    log = tool.parse_log(LOG)
    assert log.errors == 14976 and log.hazards is None
    assert (log.total, log.started, log.done, log.compiled) == (3, 3, True, 0) and log.device == "NVIDIA H200, sm_90"
    assert log.failed == [("rope/float32/B2 Hq4 Hk2 S67 D64/bhsd",
                           "RuntimeError: CUDA error: unspecified launch failure")]
    assert len(log.reports) == 1
    r = log.reports[0]
    assert r.case == "norm/rms_norm/float16/6x64/llama/weight+offset=1.0"
    assert r.text == "Invalid __global__ read of size 16 bytes" and r.where.startswith("void norm_fwd<float, (bool)0")

    clean = tool.parse_log("[sanitize] 2 cases (x)\n[sanitize] case 1/2 a\n[sanitize] case 2/2 b\n"
                           "[sanitize] done 2 cases, 0 failed, 0 kernels compiled, 1.0 s\n"
                           "========= ERROR SUMMARY: 0 errors\n")
    assert clean.errors == 0 and not clean.reports and tool.clean("memcheck", [clean])
    assert tool.summary_line("memcheck", [clean], 12.3, []) == "memcheck: 0 errors (2 cases, 12 s)"
    assert tool.parse_log("========= ERROR SUMMARY: 1 error\n").errors == 1
    assert tool.parse_log("no summary\n").errors is None

    race = tool.parse_log("[sanitize] 1 cases (x)\n[sanitize] case 1/1 attention/a\n"
                          "========= Error: Race reported between Write access at void attention_fwd<cuk::bf16>(int)"
                          "+0x460 in attention_fwd.cu:41\n"
                          "=========     and Read access at void attention_fwd<cuk::bf16>(int)+0x7a0 in "
                          "attention_fwd.cu:51 [508 hazards]\n"
                          "========= Warning: Race reported between Read access at f()+0x10\n"
                          "[sanitize] done 1 cases, 0 failed, 0 kernels compiled, 1.0 s\n"
                          "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n"
                          "========= ERROR SUMMARY: 1 error\n")
    assert race.hazards == (3, 1, 2) and race.errors == 1 and len(race.reports) == 2
    assert race.reports[0].case == "attention/a" and race.reports[0].text.startswith("Error: Race reported")
    assert race.reports[0].where == "void attention_fwd<cuk::bf16>(int)"
    assert tool.kernel_of(race.reports[0].where) == "attention_fwd" and tool.kernel_of(r.where) == "norm_fwd"
    assert tool.kernel_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_kernel") not in \
        tool.cukern_kernels() and "attention_fwd_sm90" in tool.cukern_kernels()
    assert not tool.clean("racecheck", [race])
    assert tool.summary_line("racecheck", [race], 40, ["x"]) == \
        "racecheck: 1 error, 3 hazards displayed (1 error, 2 warnings) (1 cases, 40 s); x"
    quiet = tool.parse_log("[sanitize] done 0 cases, 0 failed, 0 kernels compiled, 0.1 s\n"
                           "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
                           "========= ERROR SUMMARY: 0 errors\n")
    assert quiet.hazards == (0, 0, 0) and tool.clean("racecheck", [quiet])
    # (racecheck of compute-sanitizer 2025.3 prints its own summary alone: its errors count)
    alone = tool.parse_log("[sanitize] done 1 cases, 0 failed, 0 kernels compiled, 0.1 s\n"
                           "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n")
    assert alone.errors == 1 and alone.hazards == (2, 1, 1) and not tool.clean("racecheck", [alone])
    assert tool.parse_log("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
                          "[sanitize] done 1 cases, 0 failed, 0 kernels compiled, 0.1 s\n").errors == 0


FAKE_SANITIZER = """\
#!{python}
# compute-sanitizer's stand-in: runs the program, then prints the summaries (and FAKE_ERRORS reports).
import os, subprocess, sys, time
args = sys.argv[1:]
if "--run" in args:   # (a run of the cases: FAKE_SLEEP seconds late)
    time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
if "--help" in args:
    print("--tool --padding --track-unused-memory --racecheck-report --show-backtrace --error-exitcode")
    sys.exit(0)
tool = args[args.index("--tool") + 1]
rc = subprocess.call(args[args.index({python!r}):])
n = int(os.environ.get("FAKE_ERRORS", "0"))
for _ in range(n):
    print("========= Invalid __global__ write of size 4 bytes")
    print("=========     at void glu_fwd<float, 0, 4, 256>(const float *)+0x80 in swiglu.cu:10")
if tool == "racecheck":
    print(f"========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
print(f"========= ERROR SUMMARY: {{n}} error{{'' if n == 1 else 's'}}")
sys.exit(rc)
"""


PICKY_SANITIZER = """\
#!{python}
# refuses --check-bulk-copy, and (FAKE_UNSUPPORTED) the device
import os, sys
if any(a.startswith("--check-bulk-copy") for a in sys.argv):
    print("Error: unrecognised option '--check-bulk-copy=yes'")
    sys.exit(1)
if os.environ.get("FAKE_UNSUPPORTED"):
    print("========= Error: Device not supported")
print("========= ERROR SUMMARY: 0 errors")
"""


def test_the_optional_flags_are_those_this_sanitizer_takes(tmp_path):
    tool = _tool()
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(PICKY_SANITIZER.format(python=sys.executable))
    fake.chmod(0o755)
    listed = "--tool --padding --check-bulk-copy --check-warpgroup-mma --show-backtrace --track-unused-memory"
    flags, note = tool.tool_flags(str(fake), "memcheck", listed, dict(os.environ), "pass")
    assert flags == ["--error-exitcode", "0", "--print-limit", "20", "--show-backtrace=device", "--padding=1024",
                     "--check-warpgroup-mma=yes"]
    assert note == "flags refused: --check-bulk-copy"
    flags, note = tool.tool_flags(str(fake), "initcheck", listed, dict(os.environ), "pass")
    assert flags[-1:] == ["--show-backtrace=device"] and note is None   # (initcheck: no options of its own)
    flags, note = tool.tool_flags(str(fake), "racecheck", listed, dict(os.environ, FAKE_UNSUPPORTED="1"), "pass")
    assert flags is None and "cannot check this device (========= Error: Device not supported)" in note


def test_a_whole_run_with_a_stand_in_sanitizer(tmp_path):
    """The driver end to end on the CPU: the warm-up, the tools' processes in parallel (the dry
    run's cases), the logs read and summarized, the exit status."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(textwrap.dedent(FAKE_SANITIZER.format(python=sys.executable)))
    fake.chmod(0o755)
    base = [sys.executable, str(TOOL), "--dry", "--sanitizer", str(fake), "--family", "swiglu,rope",
            "--tools", "memcheck,racecheck", "--jobs", "1", "--shards", "2"]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    # (the three runs at once: each is mostly processes starting)
    t0 = time.monotonic()
    runs = {name: subprocess.Popen(base + ["--out", str(tmp_path / name), *extra], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=dict(env, **more))
            for name, extra, more in (
                ("ok", [], {}),
                ("bad", ["--tools", "memcheck", "--no-warmup"], {"FAKE_ERRORS": "2"}),
                # (processes past their time: stopped, and said so)
                ("slow", ["--tools", "synccheck", "--no-warmup", "--timeout", "1"], {"FAKE_SLEEP": "60"}))}
    outs = {name: (p.communicate(timeout=600)[0], p.returncode) for name, p in runs.items()}
    elapsed = time.monotonic() - t0

    out, rc = outs["ok"]
    assert rc == 0, out
    n = len([c for name in ("swiglu", "rope") for c in sc.cases(name) if c.host])
    assert re.search(rf"^warm-up: {n} cases", out, re.M), out
    assert re.search(rf"^memcheck: 0 errors \({n} cases, \d+ s\)$", out, re.M), out
    assert re.search(rf"^racecheck: 0 errors, 0 hazards displayed \(0 errors, 0 warnings\) \({n} cases", out, re.M), out
    # (one log a tool, whatever the processes: the summary, the warm-up's and the tools')
    assert sorted(f.name for f in (tmp_path / "ok").iterdir()) == ["memcheck.log", "racecheck.log", "summary.txt",
                                                                 "warmup.log"]
    assert "#### memcheck-1 (exit code 0" in (tmp_path / "ok" / "memcheck.log").read_text()

    out, rc = outs["bad"]
    assert rc == 1, out
    assert re.search(r"^memcheck: 4 errors \(", out, re.M), out   # (two processes, two each)
    assert "Invalid __global__ write of size 4 bytes" in out and "at void glu_fwd<float" in out

    out, rc = outs["slow"]
    assert rc == 1 and elapsed < 50, out
    assert re.search(r"^synccheck: \? errors \(0 cases, \d+ s\); synccheck-0 stopped after \d+ s at case 0/\?", out,
                     re.M), out


def test_initcheck_processes_store_o_without_tma(monkeypatch):
    """initcheck's processes (and their warm-up) run the Hopper forward with O by st.global:
    the tool does not register every write of a TMA store (sanitize_cases.TOOL_ENV)."""
    import dataclasses

    attn = importlib.import_module("cukern.attention")
    shipped = attn.configs.CONFIGS
    assert any(c.persistent for _, c in shipped.fwd_sm90 + shipped.fwd_sm90_full)
    assert sc.TOOL_ENV["initcheck"]["CUKERN_SANITIZE_O_BY_STORES"] == "1"
    monkeypatch.setattr(attn.configs, "CONFIGS", shipped)
    monkeypatch.delenv("CUKERN_SANITIZE_O_BY_STORES", raising=False)
    monkeypatch.delenv("CUKERN_SANITIZE_NO_CUBLAS", raising=False)
    sc.configure_for_tool()
    assert attn.configs.CONFIGS is shipped
    monkeypatch.setenv("CUKERN_SANITIZE_O_BY_STORES", "1")
    sc.configure_for_tool()
    changed = attn.configs.CONFIGS
    assert not any(c.persistent for _, c in changed.fwd_sm90 + changed.fwd_sm90_full)
    for which in ("fwd_sm90", "fwd_sm90_full"):   # (only persistence changes; every instance still valid)
        for (d, c), (_, s) in zip(getattr(changed, which), getattr(shipped, which)):
            assert dataclasses.replace(s, persistent=False) == c
            for dt in ("float16", "bfloat16"):
                c.instance(dt, d, 1, dv=changed.dv(d))
                c.instance(dt, d, 0, dv=changed.dv(d))
    tool = _tool()
    assert tool._tool_env("initcheck") == sc.TOOL_ENV["initcheck"] and tool._tool_env("memcheck") == {}


def test_initcheck_processes_compute_the_moe_blocks_products_without_cublas(monkeypatch):
    """initcheck's processes compute the MoE block's router products by broadcast sums (the tool
    does not see cuBLAS's stores on Hopper: sanitize_cases.TOOL_ENV), the same product."""
    torch = pytest.importorskip("torch")
    from cukern.moe import block

    assert sc.TOOL_ENV["initcheck"]["CUKERN_SANITIZE_NO_CUBLAS"] == "1" and "moe" in sc.TOOL_ENV_FAMILIES["initcheck"]
    monkeypatch.setattr(block, "_matmul", block._matmul)
    shipped = block._matmul
    monkeypatch.delenv("CUKERN_SANITIZE_O_BY_STORES", raising=False)
    monkeypatch.delenv("CUKERN_SANITIZE_NO_CUBLAS", raising=False)
    sc.configure_for_tool()
    assert block._matmul is shipped
    monkeypatch.setenv("CUKERN_SANITIZE_NO_CUBLAS", "1")
    sc.configure_for_tool()
    assert block._matmul is sc.product_by_sums
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(7, 3, generator=g, dtype=torch.float64)
    # (summed in float32)
    torch.testing.assert_close(block._matmul(a, b), a @ b, rtol=1e-5, atol=1e-5)
    # (the CPU dry run sets the tool's environment too: its host arrays take NumPy's product)
    with sc.dry_run():
        for case in sc.cases("moe"):
            if not case.ops:   # (the array cases; the custom op's take CUDA tensors)
                case.run()
