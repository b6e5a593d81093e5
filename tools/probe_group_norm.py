"""Probe GroupNorm on a GPU: device times at several groupings of the same bytes,
channels-last tile sizes, and (mode ncu) one forward and backward a layout for Nsight Compute.

    python3 tools/probe_group_norm.py time
    ncu --clock-control none --metrics dram__bytes_read.sum,... -k regex:group_norm \\
        python3 tools/probe_group_norm.py ncu
"""
import dataclasses
import importlib
import sys

import torch

import cukern
from cukern import _bench

gn = importlib.import_module("cukern.group_norm")


def make(shape, cl):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    return x.movedim(1, -1).contiguous().movedim(-1, 1) if cl else x


def main(mode):
    if mode == "ncu":
        for cl in (False, True):
            x, dy = make((16, 512, 64, 64), cl), make((16, 512, 64, 64), cl)
            w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
            y, m, r = cukern.group_norm(x, 32, w, w, return_stats=True)
            cukern.group_norm_backward(dy, x, 32, w, m, r)
        torch.cuda.synchronize()
        return
    copy = _bench.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy {copy:.0f} GB/s")
    runs = [((16, 512, 64, 64), 32, ts) for ts in (1, 0)]
    runs += [((64, 512, 32, 32), 8, 1), ((256, 512, 16, 16), 2, 1), ((16, 512, 64, 64), 128, 1)]
    for shape, g, tiles_per_sm in runs:
        configs = dataclasses.replace(gn.CONFIGS, tiles_per_sm=tiles_per_sm)   # (a new object; CONFIGS stays)
        for cl in (False, True):
            x, dy = make(shape, cl), make(shape, cl)
            w = torch.randn(shape[1], device="cuda", dtype=torch.bfloat16)
            y, m, r = gn._forward(x, g, w, w, 1e-5, True, configs)
            f = _bench.time_cuda(lambda: gn._forward(x, g, w, w, 1e-5, True, configs), warmup=5, reps=30)
            b = _bench.time_cuda(lambda: gn._backward(dy, x, g, w, m, r, configs), warmup=5, reps=30)
            nb = x.numel() * 2
            print(f"{shape} groups {g} {'channels_last' if cl else 'contiguous'} (CL_TILES_PER_SM {tiles_per_sm}): "
                  f"fwd {f*1e3:.1f} us {2*nb/f/1e6/copy*100:.0f}% | bwd {b*1e3:.1f} us {3*nb/b/1e6/copy*100:.0f}%")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "time")
