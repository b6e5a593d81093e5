"""Training the demo model with and without ``cukern.torch.patch()`` (``python -m cukern
train-demo``). On one GPU as it is; under ``torchrun`` the model is wrapped in
DistributedDataParallel, each rank drawing its own batches on its own GPU.
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import torch

from .options import Config
from .model import GPT, batch, params


def _dist():
    """(rank, world, local device) under torchrun; (0, 1, cuda current) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl")
        return dist.get_rank(), world, torch.device("cuda", local)
    return 0, 1, torch.device("cuda", torch.cuda.current_device())


def train(cfg: Config, *, steps: int, batch_size: int, patched: bool, compiled: bool = False, accum: int = 1,
          seed: int = 0, lr: float = 6e-4, timed_from: int = 5, log=None, ops=None) -> dict:
    """Train ``steps`` optimizer steps (each ``accum`` micro-batches) in bf16 autocast.
    Returns {"losses": [...], "tokens_per_s": ..., "counts": ...} (rank 0's losses, averaged
    over ranks under DDP; tokens/s summed over ranks, from step ``timed_from`` on)."""
    import cukern.torch as ct

    rank, world, device = _dist()
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    step_fn = torch.compile(model) if compiled else model
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    ct.reset_counts()
    losses, t0 = [], None
    ctx = ct.patch(ops) if patched else contextlib.nullcontext()
    with ctx:
        for step in range(steps):
            if step == timed_from:
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            for g in opt.param_groups:   # warm-up then cosine
                g["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
            total = torch.zeros((), device=device)
            for _ in range(accum):
                tokens, targets = batch(gen, batch_size, cfg.seq, cfg.vocab, device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = step_fn(tokens, targets) / accum
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if world > 1:
                import torch.distributed as dist
                dist.all_reduce(total)
                total /= world
            losses.append(total)
            if log and (step % 20 == 0 or step == steps - 1):
                log(f"  step {step:4d}  loss {total.item():.4f}")
        torch.cuda.synchronize(device)
    # Which CUDA devices cukern's kernels were built for, over all ranks (each rank's own).
    from cukern._kernels import cached_instances
    devices = sorted({d for _, _, d in cached_instances()})
    if world > 1:
        import torch.distributed as dist
        every = [None] * world
        dist.all_gather_object(every, devices)
        devices = [d for rank_devices in every for d in rank_devices]
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    timed = max(0, steps - timed_from)
    tps = timed * accum * batch_size * cfg.seq * world / elapsed if timed else float("nan")
    return {"losses": [float(x) for x in torch.stack(losses).tolist()], "tokens_per_s": tps,
            "counts": ct.counts(), "params": params(model), "rank": rank, "kernel_devices": devices}
