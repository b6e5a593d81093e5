"""Which routed part moves a model's first loss: step 0's loss of the demo's setup
(``tools/loss_sensitivity.py``: 12 layers, batch 4, seq 2048, bf16 autocast, seed 0, PyTorch's
deterministic algorithms) in PyTorch eager, then with ``patch(model, parts=(p,))`` for each part
alone and with every part, printed as |loss - eager's| (docs/notes-models.md); and, as PyTorch's
own scale, eager with its scaled_dot_product_attention held to each of its backends.

    python tools/probe_first_loss.py MODEL [MODEL ...]
"""
from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import cukern.torch as ct
from cukern.demo import deterministic
from cukern.demo.model import batch
from cukern.demo.options import Config
from cukern.demo.training import build


def first_loss(model, loss_of, tokens) -> float:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_of(model, tokens, tokens)
    return float(loss.detach())


def main(models: list[str]) -> int:
    deterministic()
    device = torch.device("cuda")
    for name in models:
        torch.manual_seed(0)
        model, loss_of, vocab = build(Config(layers=12, model=name, vocab=0), device)
        tokens, _ = batch(torch.Generator(device=device).manual_seed(0), 4, 2048, vocab, device)
        eager = first_loss(model, loss_of, tokens)
        print(f"{name} eager {eager:.6f}", flush=True)
        for parts in [(p,) for p in ct.PARTS if p != "moe"] + [None]:
            with ct.patch(model, parts=parts):
                loss = first_loss(model, loss_of, tokens)
            label = "all" if parts is None else parts[0]
            print(f"{name} {label:9s} |loss - eager| {abs(loss - eager):.2e}  ({loss:.6f})", flush=True)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH):
            try:
                with sdpa_kernel(backend):
                    loss = first_loss(model, loss_of, tokens)
            except RuntimeError as e:   # (a backend that does not take the call)
                print(f"{name} sdpa {backend.name}: {str(e).splitlines()[0][:100]}", flush=True)
                continue
            print(f"{name} sdpa {backend.name:19s} |loss - eager| {abs(loss - eager):.2e}  ({loss:.6f})", flush=True)
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
