"""The first training steps of a fresh process, on empty and on warm caches (GPU).

A Hugging Face LLaMA built from a config (12 layers, hidden 1024, 16 heads / 4 KV heads, LLaMA
3's vocabulary, sequence 2048, batch 4, bf16 autocast, fused AdamW), trained a few steps in a
fresh process, with and without ``cukern.torch.patch(model)``; each step timed to its end on
the GPU. The scenarios (each its own process, caches in a scratch folder):

  unpatched        PyTorch alone
  empty            patched; CuPy's kernel cache and cukern's cache (cubins, the extension) empty
  no-extension     patched; the kernel caches warm, the extension's build removed
  native-off       patched with CUKERN_NATIVE=0; the kernel caches empty
  warm             patched; every cache warm (the process after the ones above)
  ranks            patched, N ranks under torchrun (DistributedDataParallel) on empty caches,
                   and one rank the same way, for the ratio

    python tools/cold_start.py                    # every scenario; needs transformers
    python tools/cold_start.py --only empty,warm --steps 8 --ranks 0
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
T_START = time.perf_counter()


def child(args) -> None:
    """One process: import, build, (patch), train ``args.steps`` steps; print a JSON line."""
    import torch

    t_import = time.perf_counter()
    import cukern.torch as ct
    from cukern.demo.hf import build
    from cukern.demo.options import Config
    from cukern.torch import _native

    import_s = time.perf_counter() - t_import
    from cukern import _kernels

    compiles = []   # (instance, seconds) of each kernel made ready (compiled or loaded from a cache)
    ready = _kernels.function

    def timed(source, instance, device, arch=None):
        if (source, instance, device) in _kernels._functions:
            return ready(source, instance, device, arch)
        t = time.perf_counter()
        fn = ready(source, instance, device, arch)
        compiles.append((instance[:90], round(time.perf_counter() - t, 3)))
        return fn

    _kernels.function = timed
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    torch.manual_seed(0)
    cfg = Config(layers=12, dim=1024, heads=16, seq=2048, vocab=0, model="llama")
    model = build(cfg).to(device)
    vocab = model.config.vocab_size
    if args.patch:
        ct.patch(model)
    if world > 1 or "LOCAL_RANK" in os.environ:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("nccl", device_id=device)
        model = DistributedDataParallel(model, device_ids=[device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab, (4, cfg.seq), device=device)
    torch.cuda.synchronize(device)
    setup_s = time.perf_counter() - t0
    steps, native = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        steps.append(time.perf_counter() - t)
        native.append(_native._module not in (None, False, _native._PENDING))
    out = {"rank": rank, "import_s": import_s, "setup_s": setup_s, "steps": steps, "native": native,
           "process_s": time.perf_counter() - T_START, "loss": float(loss.detach()),
           "kernels": compiles}
    line = json.dumps(out)
    if os.environ.get("COLD_START_DIR"):   # ranks' lines share one pipe and can interleave there
        Path(os.environ["COLD_START_DIR"], f"rank{rank}.json").write_text(line)
    print("COLD_START " + line, flush=True)
    if world > 1 or "LOCAL_RANK" in os.environ:
        import torch.distributed as dist
        dist.destroy_process_group()


def _run(cmd, env, label) -> list[dict]:
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cukern-cold-rows-") as rows_dir:
        p = subprocess.run(cmd, env=dict(env, COLD_START_DIR=rows_dir), capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t
        rows = [json.loads(f.read_text()) for f in sorted(Path(rows_dir).glob("rank*.json"))]
    if p.returncode != 0 or not rows:
        print(f"{label}: failed ({p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}", flush=True)
        return []
    for r in rows:
        r["wall_s"] = wall
    return rows


def _wait_for_builds(cache: Path, limit_s: float = 300) -> None:
    """A background build outlives the process that started it: let it finish first."""
    from cukern import _cache

    t = time.monotonic()
    for lock in (cache / "torch-ext").glob("*/build.lock") if (cache / "torch-ext").is_dir() else []:
        while _cache.held(lock) and time.monotonic() - t < limit_s:
            time.sleep(0.5)


def _line(name: str, rows: list[dict]) -> str:
    if not rows:
        return f"| {name} | failed | | | |"
    parts = []
    for r in rows:
        s = r["steps"]
        switch = next((i + 1 for i, n in enumerate(r["native"]) if n), None)
        parts.append((s[0], min(s[1:]), max(s[1:]), r["import_s"], r["setup_s"], switch, r["process_s"]))
    first = max(p[0] for p in parts)
    lo, hi = min(p[1] for p in parts), max(p[2] for p in parts)
    imp = max(p[3] for p in parts)
    setup = max(p[4] for p in parts)
    proc = max(p[6] for p in parts)
    sw = ", ".join("-" if p[5] is None else str(p[5]) for p in parts)
    return (f"| {name} | {first:.2f} s | {lo:.3f}-{hi:.3f} s | native from step {sw} | import {imp:.2f} s, "
            f"model+patch {setup:.2f} s, process to last step {proc:.1f} s |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--patch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile", action="store_true",
                    help="also run a warm patched process under cProfile (2 steps) and print where it spends time")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the torchrun scenario (0: none)")
    ap.add_argument("--only", default="", help="scenarios, comma-separated (default: all)")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    if args.child and args.profile:   # (where a warm process's first step spends its time)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(child, args)
        for key in ("cumulative", "tottime"):
            pstats.Stats(prof, stream=sys.stdout).sort_stats(key).print_stats(35)
        return 0
    if args.child:
        child(args)
        return 0
    only = set(filter(None, args.only.split(",")))
    scratch = Path(tempfile.mkdtemp(prefix="cukern-cold-"))
    cupy_dir, cukern_dir = scratch / "cupy", scratch / "cukern"
    base = dict(os.environ, CUPY_CACHE_DIR=str(cupy_dir), CUKERN_CACHE_DIR=str(cukern_dir),
                TORCH_EXTENSIONS_DIR=str(scratch / "torch-extensions"), PYTHONUNBUFFERED="1")
    base.pop("CUKERN_NATIVE", None)
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else []))
    me = [sys.executable, str(Path(__file__).resolve()), "--child", "--steps", str(args.steps)]

    def empty() -> None:
        _wait_for_builds(cukern_dir)
        shutil.rmtree(cupy_dir, ignore_errors=True)
        shutil.rmtree(cukern_dir, ignore_errors=True)

    results, lines = {}, []

    def scenario(name, cmd, env, prepare=None):
        if only and name not in only:
            return
        if prepare:
            prepare()
        rows = _run(cmd, env, name)
        results[name] = rows
        lines.append(_line(name, rows))
        print(lines[-1], flush=True)

    scenario("unpatched", me, base)
    scenario("unpatched-again", me, base)
    scenario("empty", me + ["--patch"], base, empty)

    def drop_extension():
        _wait_for_builds(cukern_dir)
        shutil.rmtree(cukern_dir / "torch-ext", ignore_errors=True)
    scenario("no-extension", me + ["--patch"], base, drop_extension)

    def drop_kernels():
        _wait_for_builds(cukern_dir)
        shutil.rmtree(cupy_dir, ignore_errors=True)
        shutil.rmtree(cukern_dir / "cubin", ignore_errors=True)
    scenario("native-off", me + ["--patch"], dict(base, CUKERN_NATIVE="0"), drop_kernels)
    scenario("warm", me + ["--patch"], base, lambda: _wait_for_builds(cukern_dir))
    if args.profile:
        p = subprocess.run(me[:2] + ["--child", "--patch", "--profile", "--steps", "2"], env=base,
                           capture_output=True, text=True, cwd=ROOT)
        print(p.stdout[-40000:], p.stderr[-3000:], flush=True)
    if args.ranks:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        for n in (1, args.ranks):
            scenario(f"ranks-{n}", torchrun + [f"--nproc_per_node={n}"] + me[1:] + ["--patch"], base, empty)
    print("\n| scenario | first step | steps after | native path | setup |\n| --- | --- | --- | --- | --- |")
    for line in lines:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    _wait_for_builds(cukern_dir)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
