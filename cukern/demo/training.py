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


def build(cfg: Config, device):
    """(model, loss(fn, tokens, targets), vocabulary): the demo GPT, or the Hugging Face model
    ``cfg.model`` names (its own forward with ``labels``, which it shifts itself)."""
    if cfg.model == "gpt":
        return GPT(cfg).to(device), (lambda fn, tokens, targets: fn(tokens, targets)), cfg.vocab
    from .hf import build as hf_build

    model = hf_build(cfg).to(device)
    return model, (lambda fn, tokens, targets: fn(input_ids=tokens, labels=tokens).loss), model.config.vocab_size


def _layers(model):
    """The repeated blocks (FSDP shards each on its own)."""
    for path in ("blocks", "model.layers", "transformer.h"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            return list(obj)
    return []


def patch_context(model, cfg: Config, ops):
    import cukern.torch as ct

    return ct.patch(ops) if cfg.model == "gpt" else ct.patch(model, parts=ops)


def deterministic() -> None:
    """Make runs repeat bit for bit: PyTorch's deterministic algorithms, with the cuBLAS workspace
    they need (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set; call before the first matrix
    product). PyTorch's SDPA then takes its deterministic flash / memory-efficient backward
    instead of cuDNN's, and cukern's attention backward its deterministic dQ pass; the other
    cukern kernels are deterministic anyway. Two runs of one configuration then give the same
    losses, so a difference between two configurations is numerics, not run-to-run noise
    (PyTorch eager differs from itself from the first steps otherwise)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def train(cfg: Config, *, steps: int, batch_size: int, patched: bool, compiled: bool = False, accum: int = 1,
          seed: int = 0, lr: float = 6e-4, timed_from: int = 5, log=None, ops=None, fsdp: bool = False) -> dict:
    """Train ``steps`` optimizer steps (each ``accum`` micro-batches) in bf16 autocast.
    Returns {"losses": [...], "tokens_per_s": ..., "peak_gib": ..., "counts": ...} (rank 0's
    losses, averaged over ranks under DDP or FSDP; tokens/s summed over ranks, from step
    ``timed_from`` on; the peak of allocated GPU memory on rank 0)."""
    import cukern.torch as ct

    rank, world, device = _dist()
    torch.manual_seed(seed)
    model, loss_of, vocab = build(cfg, device)
    inner = model
    # (patched before wrapping: FSDP2 changes the classes patch(model) recognises)
    ctx = patch_context(inner, cfg, ops) if patched else contextlib.nullcontext()
    if patched:   # (timed on the native path, not on the Python path while its extension builds)
        from cukern.torch import _native
        _native.wait()
    if world > 1 and fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in _layers(model):
            fully_shard(layer)
        fully_shard(model)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    step_fn = torch.compile(model) if compiled else model
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    ct.reset_counts()
    torch.cuda.reset_peak_memory_stats(device)
    losses, t0 = [], None
    with ctx:
        for step in range(steps):
            if step == timed_from:
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            for g in opt.param_groups:   # warm-up then cosine
                g["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
            total = torch.zeros((), device=device)
            for _ in range(accum):
                tokens, targets = batch(gen, batch_size, cfg.seq, vocab, device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_of(step_fn, tokens, targets) / accum
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
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    return {"losses": [float(x) for x in torch.stack(losses).tolist()], "tokens_per_s": tps, "peak_gib": peak,
            "counts": ct.counts(reasons=True), "params": params(inner), "rank": rank, "kernel_devices": devices}
