"""The training demo: a GPT-2-style decoder trained on data it makes itself, with and without
``cukern.torch.patch()`` (``python -m cukern train-demo``), and the profile of its steps by
kernel category (``python -m cukern profile``).

The model is ordinary PyTorch (nn.Embedding, nn.LayerNorm or nn.RMSNorm, F.scaled_dot_product_
attention, nn.Linear, a tied head); cukern reaches it only through ``patch()``. The data are
sequences that repeat a random pattern of skewed token frequencies (the loss falls from
ln(vocab) as the model learns the frequencies, then as it learns to copy: an induction
task), drawn from a seeded generator, so two runs see the same batches.
Under ``torchrun`` the model is wrapped in DistributedDataParallel, each rank drawing its own
batches on its own GPU.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._demo_config import Config, add_model_args, config  # noqa: F401 (re-exported)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        norm = nn.RMSNorm if cfg.norm == "rms" else nn.LayerNorm
        self.heads = cfg.heads
        self.ln1, self.ln2 = norm(cfg.dim), norm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.RMSNorm(cfg.dim) if cfg.norm == "rms" else nn.LayerNorm(cfg.dim)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens, targets):
        s = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(s, device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.tok.weight)   # tied head
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def batch(gen: torch.Generator, b: int, s: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets): each row repeats a random pattern of 16-64 tokens drawn with skewed
    frequencies (token = vocab * u^3), 5% of tokens uniform noise. Drawn on the device with no
    host synchronization, so the host can queue the next step while the GPU runs this one."""
    period = torch.randint(16, 65, (1,), generator=gen, device=device)
    u = torch.rand((b, 64), generator=gen, device=device)
    pattern = (u * u * u * vocab).long().clamp_(max=vocab - 1)
    pos = torch.arange(s + 1, device=device) % period
    seq = pattern.gather(1, pos.expand(b, -1))
    noise = torch.rand(seq.shape, generator=gen, device=device) < 0.05
    seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=gen, device=device), seq)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


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


# ---- profile ---------------------------------------------------------------------------------

CATEGORIES = [
    # (cuDNN's attention backward has helper kernels: dot(dO, O) and the dQ conversion)
    ("attention", r"flash|fmha|attention|sdpa|_efficient_attention|mha|dot_do_o|convert_dq"),
    ("matrix multiply", r"gemm|cutlass|xmma|nvjet|cublas|matmul|splitK"),
    # (PyTorch's LayerNorm weight/bias gradient is GammaBetaBackward; GroupNorm's statistics
    # kernels are RowwiseMoments and ComputeFusedParams)
    ("normalization", r"layer_norm|rms_norm|group_norm|norm_fwd|norm_bwd|batch_norm|GammaBeta|RowwiseMoments|"
                      r"ComputeFusedParams|GroupNorm|LayerNorm|RMSNorm|partial_rows"),
    ("embedding", r"embedding|index_select|indexSelect|RadixSort|radix_sort"),
    ("communication", r"nccl"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|fill|copy|Copy|cat|gelu|softmax|cross_entropy|"
                    r"nll_loss|adam|Adam|foreach|multi_tensor|add|mul|where|arange|rand|Random|distribution"),
]


def category(kernel_name: str) -> str:
    for name, pattern in CATEGORIES:
        if re.search(pattern, kernel_name):
            return name
    return "other"


def profile_steps(cfg: Config, *, steps: int, batch_size: int, patched: bool, warmup: int = 3, ops=None,
                  ) -> tuple[dict, dict]:
    """GPU time a step over ``steps`` training steps (after ``warmup``): ({category: ms},
    {kernel name: ms})."""
    import cukern.torch as ct

    _, _, device = _dist()
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)
    ctx = ct.patch(ops) if patched else contextlib.nullcontext()

    def step():
        tokens, targets = batch(gen, batch_size, cfg.seq, cfg.vocab, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with ctx:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
    shares: dict[str, float] = {name: 0.0 for name, _ in CATEGORIES}
    shares["other"] = 0.0
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            ms = e.device_time_total / 1e3 / steps
            shares[category(e.key)] += ms
            kernels[e.key] = kernels.get(e.key, 0.0) + ms
    return shares, kernels


def format_top(kernels: dict, n: int, title: str) -> str:
    """The ``n`` kernels with the most GPU time a step, with their categories."""
    total = sum(kernels.values())
    lines = [f"{title}: the {n} largest kernels (ms a step, share, category)"]
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:n]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"  {ms:8.2f} {ms / total * 100:5.1f}%  {category(name):15s} {short}")
    return "\n".join(lines)


def format_shares(before: dict, after: dict) -> str:
    tb, ta = sum(before.values()), sum(after.values())
    lines = [f"{'category':16s} {'PyTorch ms':>11s} {'share':>6s}   {'patched ms':>11s} {'share':>6s}"]
    for k in before:
        lines.append(f"{k:16s} {before[k]:11.2f} {before[k] / tb * 100:5.1f}%   {after[k]:11.2f} {after[k] / ta * 100:5.1f}%")
    lines.append(f"{'GPU time a step':16s} {tb:11.2f} {'':6s}   {ta:11.2f}   ({tb / ta:.2f}x)")
    return "\n".join(lines)


def chart(before: dict, after: dict, path: str) -> bool:
    """A stacked bar chart of the two profiles (False when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    left = [0.0, 0.0]
    for k in before:
        vals = [before[k], after[k]]
        ax.barh(["PyTorch", "cukern.patch()"], vals, left=left, label=k)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("GPU time a training step (ms)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


