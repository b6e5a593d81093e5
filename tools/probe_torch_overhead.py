"""Host cost of cukern.torch's launch paths, on tensors small enough that the GPU waits for the
host (so wall time a call is host time a call).

    python tools/probe_torch_overhead.py [--iters 400] [--steps 30] [--profile]

Prints µs a call (forward + backward, and forward without autograd) for PyTorch's function,
cukern.torch's drop-in (what the patched F.* calls outside torch.compile), the custom op
(``torch.ops.cukern.*``, what compiled graphs call) and the bare array function; then the
host time a training step of a tiny demo GPT (24 layers, dim 256, seq 128: GPU time
negligible) unpatched and patched; ``--profile`` adds a cProfile of the drop-in layer_norm.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import cukern
import cukern.torch as ct
from cukern import demo
from cukern.torch import _tools


def per_call_us(fn, iters: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


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
    xg = torch.randn(4, 64, 8, 8, device=dev, requires_grad=True)
    wg = torch.randn(64, device=dev, requires_grad=True)
    qt = q.transpose(1, 2)
    ops = torch.ops.cukern
    return {
        "layer_norm": (lambda: F.layer_norm(x, (1024,), w, b), lambda: ct.layer_norm(x, (1024,), w, b),
                       lambda: ops.layer_norm(x, w, b, 1e-5)[0],
                       lambda: cukern.layer_norm(x.detach(), w.detach(), b.detach()), gy),
        "rms_norm": (lambda: F.rms_norm(x, (1024,), w), lambda: ct.rms_norm(x, (1024,), w),
                     lambda: ops.rms_norm(x, w, 1e-6)[0], lambda: cukern.rms_norm(x.detach(), w.detach()), gy),
        "group_norm": (lambda: F.group_norm(xg, 8, wg, wg), lambda: ct.group_norm(xg, 8, wg, wg),
                       lambda: ops.group_norm(xg, 8, wg, wg, 1e-5)[0],
                       lambda: cukern.group_norm(xg.detach(), 8, wg.detach(), wg.detach()), xg.detach()),
        "embedding": (lambda: F.embedding(idx, emb), lambda: ct.embedding(idx, emb),
                      lambda: ops.embedding(idx, emb, None, False), lambda: cukern.embedding(idx, emb.detach()), ge),
        "sdpa (causal)": (lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                          lambda: ct.scaled_dot_product_attention(q, q, q, is_causal=True),
                          lambda: ops.attention(qt, qt, qt, True, 0.125)[0].transpose(1, 2),
                          lambda: cukern.attention(qt.detach(), qt.detach(), qt.detach(), causal=True), go),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    _tools.prepare()

    print(f"{'op':14s} {'fwd+bwd µs: torch':>18s} {'drop-in':>8s} {'op':>7s}   "
          f"{'fwd no-grad: torch':>18s} {'drop-in':>8s} {'array':>7s}")
    for name, (ref, dropin, op, array, grad) in cases().items():
        both = [per_call_us(lambda f=f: torch.autograd.backward(f(), grad), a.iters) for f in (ref, dropin, op)]
        with torch.no_grad():
            fwd = [per_call_us(f, a.iters) for f in (ref, dropin, array)]
        print(f"{name:14s} {both[0]:18.1f} {both[1]:8.1f} {both[2]:7.1f}   {fwd[0]:18.1f} {fwd[1]:8.1f} {fwd[2]:7.1f}")

    cfg = demo.Config(layers=24, dim=256, heads=4, vocab=1024, seq=128)
    for patched in ((False, True) if a.steps else ()):
        r = demo.train(cfg, steps=a.steps, batch_size=1, patched=patched)
        print(f"tiny demo step ({'patched' if patched else 'PyTorch'}): "
              f"{cfg.seq / r['tokens_per_s'] * 1e3:.2f} ms of host time")

    if a.profile:
        ref, dropin, _, _, grad = cases()["layer_norm"]
        prof = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(False):   # (backward on the profiled thread)
            prof.enable()
            for _ in range(a.iters):
                torch.autograd.backward(dropin(), grad)
            torch.cuda.synchronize()
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
