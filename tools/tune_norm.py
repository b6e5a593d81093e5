"""Time LayerNorm / RMSNorm row configurations at one shape against torch, in one process (on a GPU).

    python3 tools/tune_norm.py [CANDIDATES.txt] [--rows 65536] [--cols 4096] [--fp8]

CANDIDATES.txt lists norm.RowConfig candidates, one a line: ``fwd|bwd NV G THREADS R MINB``
(e.g. from a no-spill sweep with cukern._nvrtc on the CPU); without it the shipped table is
timed. Each candidate is passed to the fronts in a Configs object of its own (the shipped
CONFIGS is never changed) and timed with CUDA events, printed with GB/s on the byte floor, %
of the copy bandwidth measured in the same run, and the speed-up over torch for the same step.
With --fp8 the forward candidates are also timed with an e4m3 output (scale and amax, 3 bytes
an element: the byte floor of the fp8 rows), against torch's norm, amax and scaled cast.
"""
import argparse
import importlib

import torch
import torch.nn.functional as F

from cukern import _bench

norm = importlib.import_module("cukern.norm")
norm_bench = importlib.import_module("cukern.norm.bench")


def bench(fn):
    return _bench.time_cuda(fn, warmup=8, reps=40)


def candidates(path):
    if path is None:
        return [("fwd", c) for c in norm.configs.CONFIGS.fwd] + [("bwd", c) for c in norm.configs.CONFIGS.bwd]
    out = []
    for line in open(path):
        if line.strip():
            kind, *nums = line.split()
            out.append((kind, norm.RowConfig(*(int(n) for n in nums))))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("candidates", nargs="?")
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--fp8", action="store_true", help="also time the forward with an e4m3 output")
    args = p.parse_args()
    n, d = args.rows, args.cols
    copy = _bench.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy {copy:.0f} GB/s  rows {n} cols {d} bf16")
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w, b = (torch.randn(d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    nd2 = n * d * 2
    xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, b))
    t_fwd = {False: bench(lambda: F.layer_norm(x, (d,), w, b)), True: bench(lambda: F.rms_norm(x, (d,), w, 1e-6))}
    t_bwd = {False: bench(lambda: torch.autograd.grad(F.layer_norm(xg, (d,), wg, bg), (xg, wg, bg), dy))
             - t_fwd[False],
             True: bench(lambda: torch.autograd.grad(F.rms_norm(xg, (d,), wg, 1e-6), (xg, wg), dy)) - t_fwd[True]}
    scale, amax = torch.full((1,), 64.0, device="cuda"), torch.zeros(1, device="cuda")
    fp8 = {"out_dtype": "float8_e4m3fn", "scale": scale, "amax": amax}
    # (PyTorch's side as the bench times it: the norm, its amax and the scaled, saturated cast)
    t = {"x": x, "w": w, "b": b, "scale": scale}
    t_fp8 = {rms: bench(lambda: norm_bench._torch_fp8(rms, t)) for rms in (False, True)} if args.fp8 else {}

    def line(name, ms, nbytes, ref_ms):
        gbps = nbytes / ms / 1e6
        print(f"{name:64s} {ms:7.3f} ms {gbps:6.0f} GB/s {100 * gbps / copy:5.1f}%  x{ref_ms / ms:.2f}", flush=True)

    for kind, cfg in candidates(args.candidates):
        # a table of one entry: the candidate takes every row that fits it, the loop the rest
        configs = norm.Configs(fwd=(cfg,), bwd=norm.configs.CONFIGS.bwd) if kind == "fwd" else \
            norm.Configs(fwd=norm.configs.CONFIGS.fwd, bwd=(cfg,))
        if cfg.capacity * 8 < d:
            continue
        for rms in (False, True):
            _, *stats = norm._forward(rms, x, w, None if rms else b, 1e-5, None, True, configs)
            mean, rstd = (None, stats[0]) if rms else stats
            if kind == "fwd":
                ms = bench(lambda: norm._forward(rms, x, w, None if rms else b, 1e-5, None, False, configs))
                line(f"{'rms' if rms else 'ln'} {kind} {cfg}", ms, 2 * nd2, t_fwd[rms])
                if args.fp8:
                    ms = bench(lambda: norm._forward(rms, x, w, None if rms else b, 1e-5, None, False, configs,
                                                     **fp8))
                    line(f"{'rms' if rms else 'ln'} {kind} fp8 {cfg}", ms, 3 * nd2 // 2, t_fp8[rms])
            else:
                ms = bench(lambda: norm._backward(rms, dy, x, w, mean, rstd, None, configs))
                line(f"{'rms' if rms else 'ln'} {kind} {cfg}", ms, 3 * nd2, t_bwd[rms])


if __name__ == "__main__":
    main()
