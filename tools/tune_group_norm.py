"""Time GroupNorm configurations at one shape against torch, in one process (on a GPU).

    python3 tools/tune_group_norm.py [--shape 16,512,64,64] [--groups 32] [--dtype bfloat16]

Each configuration of CANDIDATES (threads, unroll, MINB, blocks an SM) is set into
cukern.group_norm.CONFIGS for one direction and layout (and, for the contiguous forward, the
kernel with the group in shared memory at each --staged thread cap), compiled, and the
forward and the backward are timed with CUDA events (median), printed in GB/s on the byte
floor (fwd 2 passes, bwd 3) and as % of the copy bandwidth measured in the same run, next to
torch's time for the same step.
"""
import argparse
import dataclasses
import importlib

import numpy as np
import torch
import torch.nn.functional as F

from cukern import _bench
gn = importlib.import_module("cukern.group_norm")  # (cukern.group_norm is also the function)

# (threads, unroll, minb, blocks an SM): group_norm.Config
CANDIDATES = {
    "fwd": [gn.Config(512, 4, 2, 1), gn.Config(512, 8, 1, 1), gn.Config(1024, 4, 1, 1), gn.Config(512, 6, 1, 1),
            gn.Config(1024, 2, 1, 1), gn.Config(512, 4, 2, 2)],
    "bwd": [gn.Config(512, 2, 1, 2), gn.Config(512, 4, 1, 1), gn.Config(1024, 2, 1, 1), gn.Config(512, 3, 1, 1),
            gn.Config(512, 2, 2, 2)],
}


def bench(fn):
    """Device time of one call (median), with the host's launch overhead hidden."""
    return _bench.time_cuda(fn, warmup=5, reps=30)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="16,512,64,64")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layouts", default="contiguous,channels_last")
    p.add_argument("--cl-tiles-per-sm", default="1", help="comma-separated tiles_per_sm values to try")
    p.add_argument("--staged", default="256,512,1024",
                   type=lambda v: [int(t) for t in v.split(",") if t], help="the staged forward's thread caps to try")
    args = p.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    g = args.groups
    dt = getattr(torch, args.dtype)
    copy = _bench.copy_bandwidth()
    nbytes = np.prod(shape) * torch.finfo(dt).bits // 8
    print(f"{torch.cuda.get_device_name()}  copy {copy:.0f} GB/s  shape {shape} groups {g} {args.dtype}")
    runs = [(name == "channels_last", t) for name in args.layouts.split(",")
            for t in ([float(t) for t in args.cl_tiles_per_sm.split(",")] if name == "channels_last" else [1])]
    for cl, tiles_per_sm in runs:
        # (new objects; CONFIGS stays) the two-read kernels' rows with the staged forward off
        base = dataclasses.replace(gn.CONFIGS, tiles_per_sm=tiles_per_sm, fwd_staged=0)
        x = torch.randn(shape, device="cuda", dtype=dt)
        dy = torch.randn(shape, device="cuda", dtype=dt)
        if cl:
            x, dy = (a.movedim(1, -1).contiguous().movedim(-1, 1) for a in (x, dy))
        w = torch.randn(shape[1], device="cuda", dtype=dt)
        b = torch.randn(shape[1], device="cuda", dtype=dt)
        xg, wg, bg = (a.clone().requires_grad_(True) for a in (x, w, b))
        t_fwd = bench(lambda: F.group_norm(x, g, w, b))
        yt = F.group_norm(xg, g, wg, bg)
        t_bwd = bench(lambda: torch.autograd.grad(yt, (xg, wg, bg), dy, retain_graph=True))
        layout = f"channels_last (tiles_per_sm {tiles_per_sm:g})" if cl else "contiguous"
        print(f"\n{layout}: torch fwd {t_fwd * 1e3:.1f} us, bwd {t_bwd * 1e3:.1f} us, "
              f"fwd+bwd {(t_fwd + t_bwd) * 1e3:.1f} us")
        y0, mean, rstd = gn._forward(x, g, w, b, 1e-5, True, base)
        # (the contiguous forward: also the staged kernel, at most `threads` a block)
        staged = [] if cl else [("fwd", f"staged {t}", dataclasses.replace(base, fwd_staged=t)) for t in args.staged]
        runs = [(kind, cfg, dataclasses.replace(base, **{kind + ("_cl" if cl else ""): cfg}))
                for kind in ("fwd", "bwd") for cfg in CANDIDATES[kind]] + staged
        for kind, cfg, configs in runs:
            try:
                if kind == "fwd":
                    fn = lambda: gn._forward(x, g, w, b, 1e-5, True, configs)  # noqa: E731
                    passes = 2
                    # (y of this configuration against the default's: the statistics' order may differ)
                    diff = f"  max |y - y0| {(fn()[0].float() - y0.float()).abs().max().item():.3g}"
                else:
                    fn = lambda: gn._backward(dy, x, g, w, mean, rstd, configs)  # noqa: E731
                    passes = 3
                    diff = ""
                ms = bench(fn)
                gbps = passes * nbytes / ms / 1e6
                ref_ms = t_fwd if kind == "fwd" else t_bwd
                print(f"  {kind} {cfg}: {ms*1e3:7.1f} us  {gbps:6.0f} GB/s  {100*gbps/copy:5.1f}% of copy  "
                      f"{ref_ms/ms:5.2f}x torch{diff}")
            except Exception as e:  # a configuration that does not compile or launch
                print(f"  {kind} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
