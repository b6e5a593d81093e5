"""``python -m cukern info | bench | train-demo | profile``: what cukern sees here, the
benchmark against PyTorch, the training demo with and without ``cukern.torch.patch()``, and
the profile of its steps by kernel category.

``info`` (and ``bench --list``) work on any machine. The others need a CUDA GPU, a CUDA build
of torch and CuPy; without them they say what is missing, with the same hints, and exit with
status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

EXIT_UNAVAILABLE = 2


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


# ---- info ------------------------------------------------------------------------------------

def _gpu_lines() -> list[str]:
    try:
        import cupy
    except Exception:  # noqa: BLE001
        cupy = None
    if cupy is not None:
        from cukern._environment import gpu_unavailable_reason

        rt = cupy.cuda.runtime
        reason = gpu_unavailable_reason()
        if reason is not None:
            return [f"GPU:          no CUDA GPU found: {reason}"]
        count = rt.getDeviceCount()
        lines = []
        try:
            d = rt.driverGetVersion()
            lines.append(f"CUDA driver:  {d // 1000}.{d % 1000 // 10}")
        except Exception:  # noqa: BLE001
            pass
        for i in range(count):
            try:
                p = rt.getDeviceProperties(i)
                name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
                lines.append(f"GPU {i}:        {name}, compute capability {p['major']}.{p['minor']}, "
                             f"{p['multiProcessorCount']} SMs, {_size(p['totalGlobalMem'])} memory, "
                             f"L2 {_size(p['l2CacheSize'])}")
            except Exception as e:  # noqa: BLE001
                lines.append(f"GPU {i}:        properties unavailable ({type(e).__name__}: {e})")
        return lines
    try:
        import torch
    except Exception:  # noqa: BLE001
        return ["GPU:          unknown (neither CuPy nor torch is installed to ask)"]
    if not torch.cuda.is_available():
        return ["GPU:          no CUDA GPU found (torch.cuda.is_available() is False)"]
    lines = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"GPU {i}:        {p.name}, compute capability {p.major}.{p.minor}, "
                     f"{p.multi_processor_count} SMs, {_size(p.total_memory)} memory, "
                     f"L2 {_size(p.L2_cache_size)}")
    return lines


def _cache_line() -> str:
    path = Path(os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache")))
    if not path.is_dir():
        return f"kernel cache: {path} (not created yet)"
    files = [f for f in path.rglob("*") if f.is_file()]
    total = sum(f.stat().st_size for f in files)
    return f"kernel cache: {path} ({len(files)} files, {_size(total)})"


def cmd_info(args) -> int:
    import cukern
    from cukern import _kernels, _nvrtc

    print(f"cukern:       {cukern.__version__} ({Path(cukern.__file__).resolve().parent})")
    try:
        print(f"CUDA sources: {_kernels.source_dir()}")
    except Exception as e:  # noqa: BLE001
        print(f"CUDA sources: not found ({e})")
    print(f"Python:       {platform.python_version()} ({sys.executable})")
    print(f"NumPy:        {_dist_version('numpy') or 'not installed'}")
    try:
        import cupy

        try:
            rt = cupy.cuda.runtime.runtimeGetVersion()
            rts = f", CUDA runtime {rt // 1000}.{rt % 1000 // 10}"
        except Exception:  # noqa: BLE001
            rts = ""
        print(f"CuPy:         {cupy.__version__}{rts}")
    except Exception as e:  # noqa: BLE001
        print(f"CuPy:         not installed ({type(e).__name__}: {e})")
    print(f"PyTorch:      {_dist_version('torch') or 'not installed'}")
    try:
        major, minor = _nvrtc.version()
        print(f"NVRTC:        {major}.{minor} ({getattr(_nvrtc.library(), '_name', '?')})")
    except Exception as e:  # noqa: BLE001
        print(f"NVRTC:        not found ({e})")
    for line in _gpu_lines():
        print(line)
    print(_cache_line())
    return 0


# ---- bench -----------------------------------------------------------------------------------

class _Progress:
    """``[i/n] case ...`` on stderr: rewritten in place on a terminal, one line each otherwise."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()

    def __call__(self, i: int, n: int, case) -> None:
        msg = f"[{i}/{n}] {case.name} ..."
        if self.tty:
            self.stream.write("\r\033[K" + msg)
        else:
            self.stream.write(msg + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def cmd_bench(args) -> int:
    from cukern import _bench

    table = _bench.torch_cases(quick=args.quick) if args.torch else _bench.cases(quick=args.quick)
    selected = [c for c in table if not args.filter or args.filter.lower() in c.name.lower()]
    if args.list:
        for c in selected:
            print(f"{c.name:34s} {c.family:10s} {c.shape_label} {c.dtype}")
        return 0
    if not selected:
        names = ", ".join(c.name for c in table)
        print(f"cukern bench: no case matches --filter {args.filter!r} (cases: {names})",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    if (refused := _refuse("bench")) is not None:
        return refused

    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    reps = args.reps if args.reps is not None else (20 if args.quick else 100)
    dev, ver = _bench.device_info(), _bench.versions()
    print(f"device: {dev['name']} (compute capability {dev['capability']}, {dev['sms']} SMs, "
          f"{dev['memory_bytes'] / 2**30:.1f} GiB, L2 {dev['l2_bytes'] / 2**20:.0f} MiB)")
    print(f"cukern {ver['cukern']}, torch {ver['torch']} (CUDA {ver['torch_cuda']}), "
          f"cupy {ver['cupy']}, NVRTC {ver['nvrtc']}"
          + (f", liger-kernel {_bench.liger_version() or 'not installed'}" if args.torch else "")
          + (f", flash-attn-4 {_bench.fa4_version() or 'not installed'}" if args.torch else "")
          + (f", quack {_bench.quack_version() or 'not installed'}" if args.torch else ""))
    print(f"timing: median of {reps} runs after {warmup} warm-up, CUDA events, a case's sides in alternating blocks"
          + (" (--quick shapes)" if args.quick else ""), flush=True)
    copy = _bench.copy_bandwidth()
    print(f"copy bandwidth: {copy:.0f} GB/s (device-to-device, bytes read + written)", flush=True)
    matmul = None
    if any(c.flops is not None for c in selected):
        matmul = _bench.matmul_rate()
        print(f"matmul rate: {matmul:.0f} TFLOP/s (bf16 8192^3, torch)", flush=True)
    print(flush=True)

    if args.torch:   # (the native path timed from the first case, not the Python path while it builds)
        from cukern.torch import _native
        _native.wait()
    progress = _Progress()
    run = _bench.run_torch_cases if args.torch else _bench.run_cases
    try:
        results = run(selected, progress, warmup=warmup, reps=reps, copy_gbps=copy, matmul_tflops=matmul)
    finally:
        progress.done()
    if args.torch:
        print("through cukern.torch with autograd (the PyTorch user's call) against the array API, PyTorch "
              "eager, torch.compile and the peer libraries (Liger-Kernel, FlashAttention-4, quack); ms by the bench's "
              "method, an isolated call's ms, and host microseconds a call with the device kept busy", flush=True)
        print(_bench.format_torch_table(results))
    else:
        print(_bench.format_table(results))

    if args.json:
        record = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick, "torch": args.torch,
                  "warmup": warmup, "reps": reps, "device": dev, "versions": ver,
                  "copy_gbps": copy, "matmul_tflops": matmul, "results": results}
        Path(args.json).write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"\nresults written to {args.json}")
    return 1 if any(r.get("error") for r in results) else 0


# ---- train-demo and profile -----------------------------------------------------------------

def _refuse(command: str) -> int | None:
    """EXIT_UNAVAILABLE, with what is missing and the same hints on stderr, where a GPU command
    cannot run (bench, train-demo, profile alike)."""
    from cukern import _bench

    reason = _bench.unavailable_reason()
    if reason:
        print(f"cukern {command}: cannot run here: {reason}", file=sys.stderr)
        print(f"cukern {command} needs a CUDA GPU, a CUDA build of PyTorch and CuPy with its CUDA libraries "
              "(pip install \".[torch-cuda13]\" or \".[torch-cuda12]\"); `python -m cukern info` shows what "
              "is found.", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return None


def _ops(args):
    """--ops a,b,c -> the functions patch() routes (None: all)."""
    return tuple(o.strip() for o in args.ops.split(",") if o.strip()) if args.ops else None


def cmd_train_demo(args) -> int:
    if (refused := _refuse("train-demo")) is not None:
        return refused
    from cukern.demo import config, deterministic, train

    if args.deterministic:
        deterministic()
    cfg = config(args)
    rank = int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    compiles = {"no": [False], "yes": [True], "both": [False, True]}[args.compile]
    patches = {"both": [False, True], "on": [True], "off": [False]}[args.patch]
    what = (f"GPT {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads, vocab {cfg.vocab}, seq {cfg.seq}, "
            f"{cfg.norm} norm" if cfg.model == "gpt" else
            f"Hugging Face {cfg.model} ({cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads, seq {cfg.seq}"
            f"{f', attention dropout {cfg.attn_dropout}' if cfg.attn_dropout else ''})")
    say(f"train-demo: {what}; batch {args.batch} x accum {args.accum} x {world} rank(s)"
        f"{' (FSDP2)' if args.fsdp and world > 1 else ''}, {args.steps} steps, bf16 autocast, AdamW"
        f"{', deterministic algorithms' if args.deterministic else ''}", flush=True)
    runs = {}
    for compiled in compiles:
        for patched in patches:
            name = f"{'cukern.patch()' if patched else 'PyTorch'}{' + compile' if compiled else ''}"
            say(f"{name}:", flush=True)
            r = train(cfg, steps=args.steps, batch_size=args.batch, patched=patched, compiled=compiled,
                      accum=args.accum, seed=args.seed, log=say if args.verbose else None, ops=_ops(args),
                      fsdp=args.fsdp)
            say(f"  {r['params'] / 1e6:.0f}M parameters; loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}; "
                f"{r['tokens_per_s']:,.0f} tokens/s; peak memory {r['peak_gib']:.2f} GiB", flush=True)
            if patched and not compiled:
                say(f"  calls: {r['counts']}")
            runs[name] = r
    lines = []
    for compiled in compiles:
        suffix = " + compile" if compiled else ""
        a, b = runs.get(f"PyTorch{suffix}"), runs.get(f"cukern.patch(){suffix}")
        if a and b:
            diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
            tail = sum(abs(x - y) for x, y in zip(a["losses"][-20:], b["losses"][-20:])) / min(20, len(a["losses"]))
            lines.append(f"{'compiled' if compiled else 'eager'}: tokens/s {a['tokens_per_s']:,.0f} -> "
                         f"{b['tokens_per_s']:,.0f} ({b['tokens_per_s'] / a['tokens_per_s']:.3f}x); peak memory "
                         f"{a['peak_gib']:.2f} -> {b['peak_gib']:.2f} GiB; "
                         f"loss difference max {diff:.4f}, mean of the last 20 steps {tail:.4f}; "
                         f"final loss {a['losses'][-1]:.4f} vs {b['losses'][-1]:.4f}")
    a, b = runs.get("PyTorch + compile"), runs.get("cukern.patch()")
    if a and b:
        lines.append(f"cukern.patch() eager against PyTorch compiled: {b['tokens_per_s'] / a['tokens_per_s']:.3f}x")
    a, b = runs.get("PyTorch"), runs.get("PyTorch + compile")
    if a and b:   # the scale: PyTorch's own numerics (and, unless --deterministic, its run-to-run noise)
        diff = [abs(x - y) for x, y in zip(a["losses"], b["losses"])]
        lines.append(f"for scale, PyTorch eager vs PyTorch compiled: loss difference max {max(diff):.4f}, "
                     f"mean of the last 20 steps {sum(diff[-20:]) / len(diff[-20:]):.4f}")
    for line in lines:
        say(line)
    if world > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    if args.json and rank == 0:
        conf = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.json).write_text(json.dumps({"config": conf, "runs": runs, "summary": lines}, indent=1) + "\n")
    return 0


def cmd_profile(args) -> int:
    if (refused := _refuse("profile")) is not None:
        return refused
    from cukern import demo

    cfg = demo.config(args)
    name = "the demo GPT" if cfg.model == "gpt" else f"Hugging Face {cfg.model}"
    print(f"profile: {args.steps} training steps of {name} ({cfg.layers} layers, dim {cfg.dim}, "
          f"seq {cfg.seq}, batch {args.batch}, bf16 autocast), GPU time by kernel category", flush=True)
    before, kernels_before = demo.profile_steps(cfg, steps=args.steps, batch_size=args.batch, patched=False)
    after, kernels_after = demo.profile_steps(cfg, steps=args.steps, batch_size=args.batch, patched=True,
                                              ops=_ops(args))
    print(demo.format_shares(before, after))
    if args.top:
        print(demo.format_top(kernels_before, args.top, "PyTorch"))
        print(demo.format_top(kernels_after, args.top, "cukern.patch()"))
    if args.chart:
        if demo.chart(before, after, args.chart):
            print(f"chart written to {args.chart}")
        else:
            print("no chart: matplotlib is not installed")
    if args.json:
        Path(args.json).write_text(json.dumps({"pytorch_ms": before, "patched_ms": after, "pytorch_kernels_ms":
                                               kernels_before, "patched_kernels_ms": kernels_after}, indent=1) + "\n")
    return 0


def cmd_warmup(args) -> int:
    """Build the C++ extension and, for a model, compile its kernels, ahead of a run."""
    from cukern import _bench

    try:
        from cukern.torch import _warmup
    except ImportError as e:
        print(f"cukern warmup: needs PyTorch ({type(e).__name__}: {e})", file=sys.stderr)
        return EXIT_UNAVAILABLE

    status = 0
    if args.native:
        ok, line = _warmup.build_native()
        print(f"cukern warmup: {line}", flush=True)
        status = 0 if ok else 1
    if args.model is None and args.config is None:
        return status
    reason = _bench.unavailable_reason()
    if reason:
        print(f"cukern warmup: kernels: not compiled here ({reason}); CuPy compiles them for the GPU it finds, "
              "so run warmup where the GPU is (the first training step compiles them otherwise)", file=sys.stderr)
        return status or EXIT_UNAVAILABLE
    print("cukern warmup: " + _warmup.warm_model(args.model, args.config, dim=args.dim, heads=args.heads,
                                                   seq=args.seq, batch=args.batch, dtype=args.dtype), flush=True)
    return status


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default: the value, "off" for a flag, or what the
    help text itself says (when it names the default already)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def parser() -> argparse.ArgumentParser:
    """The command line (no torch import)."""
    fmt = _Help
    gpu = " (needs a CUDA GPU)"
    parser = argparse.ArgumentParser(
        prog="python -m cukern", formatter_class=fmt,
        description="cukern: hand-written CUDA kernels for transformer training.")
    from cukern._version import __version__
    parser.add_argument("--version", action="version", version=f"cukern {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", help="versions, GPU, NVRTC and the kernel cache (no GPU needed)", formatter_class=fmt,
                       description="What cukern finds here: its version and sources, Python, NumPy, CuPy, "
                                   "PyTorch, NVRTC, the GPUs and the kernel cache. Needs no GPU.")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser(
        "bench", help="time every op against PyTorch" + gpu, formatter_class=fmt,
        description="Time every op against its PyTorch equivalent with CUDA events, at the "
                    "workload's shapes, and report GB/s (or TFLOP/s), the share of the device's "
                    "measured copy bandwidth (or matrix rate), and the speed-up over torch. With "
                    "--torch: every family through cukern.torch with autograd, against PyTorch eager, "
                    "torch.compile and Liger-Kernel (when installed), with host time a call." + gpu + ".")
    p.add_argument("--torch", action="store_true", help="the PyTorch-path table instead of the array API's")
    p.add_argument("--quick", action="store_true", help="smaller shapes and fewer runs")
    p.add_argument("--filter", metavar="SUBSTR", help="only the cases whose name contains SUBSTR (default: all)")
    p.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON (default: no file)")
    p.add_argument("--reps", type=_positive, metavar="N", help="timed runs per case (default: 100, --quick 20)")
    p.add_argument("--warmup", type=_positive, metavar="N", help="warm-up runs per case (default: 10, --quick 3)")
    p.add_argument("--list", action="store_true", help="list the cases and exit (needs no GPU)")
    p.set_defaults(func=cmd_bench)

    from cukern.demo import options as demo_cfg   # (no torch import here)
    p = sub.add_parser(
        "train-demo", help="train the demo GPT with and without cukern.torch.patch()" + gpu, formatter_class=fmt,
        description="Train a GPT-2-style decoder on self-made data in bf16 autocast, with and without "
                    "cukern.torch.patch(), from the same seed; report the losses' agreement and tokens/s. "
                    "Runs on one GPU as it is; started by torchrun (torchrun --nproc_per_node N -m cukern "
                    "train-demo ...) it trains with DistributedDataParallel, one GPU a rank." + gpu + ".")
    demo_cfg.add_model_args(p)
    p.add_argument("--steps", type=_positive, default=200, help="optimizer steps a run")
    p.add_argument("--accum", type=_positive, default=1, help="micro-batches a step (gradient accumulation)")
    p.add_argument("--compile", choices=("no", "yes", "both"), default="no",
                   help="torch.compile the model (both: eager and compiled runs)")
    p.add_argument("--patch", choices=("both", "on", "off"), default="both",
                   help="runs with cukern.torch.patch() (on), without (off), or both")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set): "
                        "a run repeats bit for bit, so the loss differences between runs are numerics, not noise; "
                        "PyTorch's SDPA then runs its deterministic backward, so tokens/s are not the default "
                        "ones (default: off)")
    p.add_argument("--verbose", action="store_true", help="print the loss every 20 steps")
    p.add_argument("--ops", metavar="A,B", help="the functions patch() routes (default: all of cukern.torch.OPS); "
                                                "with --model, the parts patch(model) routes (default: all of "
                                                "cukern.torch.PARTS)")
    p.add_argument("--fsdp", action="store_true", help="under torchrun, FSDP2 (fully_shard a block and the root) "
                                                       "instead of DistributedDataParallel")
    p.add_argument("--json", metavar="PATH", help="also write losses and figures to PATH (default: no file)")
    p.set_defaults(func=cmd_train_demo)
    p = sub.add_parser(
        "warmup", help="build cukern.torch's C++ extension and a model's kernels ahead of a run", formatter_class=fmt,
        description="Fill the caches a run's first steps would fill: build cukern.torch's C++ extension (a C++ "
                    "compiler and ninja; no GPU needed; a failure recorded earlier is tried again) and, with "
                    "--model or --config, compile the kernels of a one-layer copy of the model at the run's "
                    "sequence length, batch and dtype (needs the GPU: CuPy compiles for the device it finds). "
                    "The caches: CUKERN_CACHE_DIR (default ~/.cache/cukern) and CUPY_CACHE_DIR (default "
                    "~/.cupy/kernel_cache); every process and rank on the machine shares them.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", choices=("gpt2", "llama", "mistral"),
                   help="a model type, built from a config at --dim and --heads (default: none)")
    g.add_argument("--config", metavar="NAME_OR_PATH",
                   help="a transformers config: a local folder or file, or a hub name (default: none)")
    p.add_argument("--dim", type=_positive, default=1024, help="model width, with --model")
    p.add_argument("--heads", type=_positive, default=16, help="attention heads, with --model")
    p.add_argument("--seq", type=_positive, default=2048, help="sequence length of the run")
    p.add_argument("--batch", type=_positive, default=1, help="sequences a micro-batch")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="the autocast dtype")
    p.add_argument("--no-native", dest="native", action="store_false",
                   help="skip the C++ extension (default: build it)")
    p.set_defaults(func=cmd_warmup)
    p = sub.add_parser(
        "profile", help="GPU time by kernel category of the demo's training steps, with and without patch()" + gpu,
        formatter_class=fmt,
        description="Run a few training steps of the demo GPT under torch.profiler, without and with "
                    "cukern.torch.patch(), and print the GPU time a step by category (attention, matrix "
                    "multiply, normalization, embedding, elementwise, communication, other)" + gpu + ".")
    demo_cfg.add_model_args(p)
    p.add_argument("--steps", type=_positive, default=5, help="profiled steps (after 3 warm-up steps)")
    p.add_argument("--chart", metavar="PNG", help="also draw a chart to PNG (needs matplotlib; default: none)")
    p.add_argument("--top", type=int, default=0, metavar="N", help="also list the N kernels with the most GPU time")
    p.add_argument("--ops", metavar="A,B", help="the functions patch() routes (default: all of cukern.torch.OPS)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH (default: no file)")
    p.set_defaults(func=cmd_profile)
    return parser


def main(argv=None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.command is None:
        top.print_help()
        return EXIT_UNAVAILABLE
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
