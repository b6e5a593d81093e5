"""Probe attention on a GPU: each kernel's device time (torch.profiler) in our forward
and backward and in FlashAttention-2's (torch SDPA FLASH_ATTENTION), or (mode ncu) one call of
each for Nsight Compute.

    python3 tools/probe_attention.py time [B H S D causal]
    ncu --clock-control none --section WarpStateStats ... -k regex:attention \\
        python3 tools/probe_attention.py ncu [B H S D causal]
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cukern


def main(mode, B=8, H=16, S=2048, D=128, causal=0):
    B, H, S, D, causal = int(B), int(H), int(S), int(D), bool(int(causal))
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))

    def ours(det):
        out, lse = cukern.attention(q, k, v, causal=causal, return_lse=True)
        return cukern.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=det)

    qt, kt, vt = (a.detach().transpose(1, 2).requires_grad_(True) for a in (q, k, v))

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2))

    runs = {"ours det=False": lambda: ours(False), "ours det=True": lambda: ours(True), "flash": flash}
    for fn in runs.values():   # compile and warm up
        fn()
    torch.cuda.synchronize()
    if mode == "ncu":
        for fn in runs.values():
            fn()
        torch.cuda.synchronize()
        return
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    print(f"{torch.cuda.get_device_name()}  B{B} H{H} S{S} d{D}{' causal' if causal else ''}")
    for name, fn in runs.items():
        reps = 5
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        total = 0.0
        print(f"  {name}:")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if e.device_time_total <= 0:
                continue
            us = e.device_time_total / reps
            total += us
            print(f"    {us / 1e3:8.3f} ms  {e.key[:110]}")
        print(f"    {total / 1e3:8.3f} ms  total = {3.5 * flops / total / 1e6:.0f} TFLOP/s fwd+bwd")


if __name__ == "__main__":
    main(*sys.argv[1:])
