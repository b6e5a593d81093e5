"""Host cost of cukern.torch's launch paths, on tensors small enough that the GPU waits for the
host (so wall time a call is host time a call).

    python tools/probe_torch_overhead.py [--iters 400] [--profile] [--steps 30]

Prints µs a call (forward + backward, and forward without autograd) for PyTorch's function,
cukern's eager path (what the patched F.* calls outside torch.compile), the custom op
(``torch.ops.cukern.*``, what compiled graphs call) and the bare array function; then the
host time a training step of a tiny demo GPT (24 layers, GPU time negligible) unpatched and
patched; ``--profile`` adds a cProfile of the eager layer_norm path.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import cukern
from cukern import demo
from cukern.torch import _eager, _functional, _ops


def per_call_us(fn, iters: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


def _enter_exit(ctx) -> None:
    with ctx:
        pass


def cases():
    dev = "cuda"
    x = torch.randn(64, 1024, device=dev, requires_grad=True)
    w = torch.randn(1024, device=dev, requires_grad=True)
    b = torch.randn(1024, device=dev, requires_grad=True)
    gy = torch.randn(64, 1024, device=dev)
    q = torch.randn(1, 4, 128, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(1, 4, 128, 64, device=dev, dtype=torch.bfloat16)
    idx = torch.randint(0, 1000, (4, 128), device=dev)
    emb = torch.randn(1000, 256, device=dev, requires_grad=True)
    ge = torch.randn(4, 128, 256, device=dev)
    qt = q.transpose(1, 2)
    return {
        "layer_norm": (
            lambda: F.layer_norm(x, (1024,), w, b),
            lambda: _functional.layer_norm(x, (1024,), w, b),
            lambda: _ops.layer_norm(x, w, b, 1e-5)[0],
            lambda: cukern.layer_norm(x.detach(), w.detach(), b.detach()),
            gy),
        "rms_norm": (
            lambda: F.rms_norm(x, (1024,), w),
            lambda: _functional.rms_norm(x, (1024,), w),
            lambda: _ops.rms_norm(x, w, 1e-6)[0],
            lambda: cukern.rms_norm(x.detach(), w.detach()),
            gy),
        "embedding": (
            lambda: F.embedding(idx, emb),
            lambda: _functional.embedding(idx, emb),
            lambda: _ops.embedding(idx, emb, None),
            lambda: cukern.embedding(idx, emb.detach()),
            ge),
        "sdpa (causal)": (
            lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
            lambda: _functional.scaled_dot_product_attention(q, q, q, is_causal=True),
            lambda: _ops.attention(qt, qt, qt, True, 0.125)[0].transpose(1, 2),
            lambda: cukern.attention(qt.detach(), qt.detach(), qt.detach(), causal=True),
            go),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    _functional.prepare()

    print(f"{'op':14s} {'fwd+bwd µs: torch':>18s} {'eager':>7s} {'op':>7s}   "
          f"{'fwd no-grad: torch':>18s} {'eager':>7s} {'array':>7s}")
    for name, (ref, eager, op, array, grad) in cases().items():
        both = [per_call_us(lambda f=f: torch.autograd.backward(f(), grad), a.iters) for f in (ref, eager, op)]
        with torch.no_grad():
            fwd = [per_call_us(f, a.iters) for f in (ref, eager, array)]
        print(f"{name:14s} {both[0]:18.1f} {both[1]:7.1f} {both[2]:7.1f}   {fwd[0]:18.1f} {fwd[1]:7.1f} {fwd[2]:7.1f}")

    cfg = demo.Config(layers=24, dim=256, heads=4, vocab=1024, seq=128)
    for patched in ((False, True) if a.steps else ()):
        r = demo.train(cfg, steps=a.steps, batch_size=1, patched=patched)
        print(f"tiny demo step ({'patched' if patched else 'PyTorch'}): "
              f"{cfg.seq / r['tokens_per_s'] * 1e3:.2f} ms of host time")

    # Where layer_norm's forward + backward host time goes.
    from cukern.norm import layer_norm as ln_fwd, layer_norm_backward as ln_bwd
    x, w, b = (t.detach() for t in (torch.randn(64, 1024, device="cuda"), torch.randn(1024, device="cuda"),
                                     torch.randn(1024, device="cuda")))
    dy = torch.randn_like(x)
    _, mean, rstd = ln_fwd(x, w, b, 1e-5, return_stats=True)
    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    parts = {
        "array forward (with stats)": lambda: ln_fwd(x, w, b, 1e-5, return_stats=True),
        "array backward": lambda: ln_bwd(dy, x, w, mean, rstd),
        "torch.empty x5": lambda: [torch.empty(64, 1024, device="cuda") for _ in range(5)],
        "Function forward (graph built)": lambda: _eager.layer_norm(xg, wg, bg, 1e-5),
        "Function forward + backward": lambda: torch.autograd.backward(_eager.layer_norm(xg, wg, bg, 1e-5), dy),
        "grad(), no accumulation": lambda: torch.autograd.grad(_eager.layer_norm(xg, wg, bg, 1e-5), (xg, wg, bg), dy),
    }
    for name, fn in parts.items():
        print(f"  layer_norm {name:34s} {per_call_us(fn, a.iters):8.1f} µs")
    with torch.autograd.set_multithreading_enabled(False):
        print(f"  layer_norm {'fwd + bwd, backward on this thread':34s} "
              f"{per_call_us(parts['Function forward + backward'], a.iters):8.1f} µs")
        print(f"  layer_norm {'PyTorch, backward on this thread':34s} "
              f"{per_call_us(lambda: torch.autograd.backward(F.layer_norm(xg, (1024,), wg, bg), dy), a.iters):8.1f} µs")

    # The stages of one array-function forward, each timed alone.
    from cukern import _arrays, _kernels
    import numpy as np
    xa = _arrays.as_device_array(x, "x")
    inst = "norm_fwd<float, false, 4, 2, 128, 128, 1, 1>"
    fn = _kernels.function("norm.cu", inst, 0)
    y = _arrays.empty(xa, xa.shape)
    args = (xa, np.int64(1024), None, np.int64(0), xa, xa, y, None, None, None, np.int64(64), np.int32(1024),
            np.float32(1e-5))

    def launch_only():
        with _arrays.launch_context(xa):
            _kernels.launch(fn, 8, 128, args)

    p, nul = np.uint64(xa.ptr), np.uint64(0)
    raw_args = (p, np.int64(1024), nul, np.int64(0), p, p, np.uint64(y.ptr), nul, nul, nul, np.int64(64),
                np.int32(1024), np.float32(1e-5))

    def raw_cupy():   # CuPy's own argument handling, for comparison
        fn((8,), (128,), raw_args)

    stages = {
        "as_device_array(x)": lambda: _arrays.as_device_array(x, "x"),
        "torch.empty(64, 1024)": lambda: torch.empty((64, 1024), dtype=torch.float32, device=x.device),
        "_arrays.empty": lambda: _arrays.empty(xa, xa.shape),
        "launch_context enter/exit": lambda: _enter_exit(_arrays.launch_context(xa)),
        "launch_context + launch": launch_only,
        "cupy RawKernel call alone": raw_cupy,
        "kernels.function lookup": lambda: _kernels.function("norm.cu", inst, 0),
        "kernels.pack_params": lambda: _kernels.pack_params(args),
        "np.int64(...) x3": lambda: (np.int64(1), np.int64(2), np.int64(3)),
    }
    for name, fn_ in stages.items():
        print(f"  stage {name:34s} {per_call_us(fn_, 4 * a.iters):8.1f} µs")

    if a.profile:
        c = cases()["layer_norm"]
        prof = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(False):   # (backward on the profiled thread)
            prof.enable()
            for _ in range(a.iters):
                torch.autograd.backward(c[1](), c[4])
            torch.cuda.synchronize()
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
