"""How far a training trajectory moves for a given change (docs/notes-models.md, v6).

Trains one of the demo's models (``train-demo``'s setup: 12 layers, batch 4, seq 2048, 200
steps, bf16 autocast, AdamW, seed 0) under PyTorch's deterministic algorithms, so that two runs
of one configuration repeat bit for bit, as: PyTorch eager (``eager``); eager with one weight
moved by one bfloat16 step (``d1``: layer 5's first weight matrix, flat index 12345; ``d2``:
layer 0's, index 777), the smallest change that autocast's cast of the weights sees; cukern's
``patched`` model; ``compiled`` (torch.compile); and ``fp32_softcap``: eager with Gemma 2's
softcaps taken in float32 (its attention scores and final logits, which eager rounds to bfloat16
before and after the tanh; cukern's kernels, FlashAttention's and torch.compile's take them in
float32). Prints each run's |loss - eager's| a step:
the maximum, the mean of the last 20 steps, the mean of all, and step 0's.

    python tools/loss_sensitivity.py MODEL OUT.json [RUNS]

MODEL: the demo's ``gpt`` or a transformers model type (``train-demo --model``); RUNS: a comma list, by default
eager,d1,d2,patched,compiled. Losses are written to OUT.json after each run.
"""
from __future__ import annotations

import json
import sys
import time

import torch

import cukern.demo.training as training
from cukern.demo import deterministic, train
from cukern.demo.options import Config

PERTURB = {"d1": ("5", 12345), "d2": ("0", 777)}   # (layer, flat index) in its first weight matrix


def _moved(build, which):
    """``build`` with one weight of the model moved by one bf16 step (None: unchanged)."""
    def moved_build(cfg, device):
        model, loss_of, vocab = build(cfg, device)
        if which is not None:
            layer, idx = PERTURB[which]
            name, p = next((n, p) for n, p in model.named_parameters()
                           if p.dim() == 2 and (f"layers.{layer}." in n or f"h.{layer}." in n))
            with torch.no_grad():
                flat = p.view(-1)
                before = flat[idx].item()
                step = torch.tensor(float("inf"), device=p.device, dtype=torch.bfloat16)
                flat[idx] = torch.nextafter(flat[idx].to(torch.bfloat16), step).float()
                after = flat[idx].item()
            print(f"  {which}: {name}[{idx}] {before!r} -> {after!r}", flush=True)
        return model, loss_of, vocab
    return moved_build


def _fp32_softcap(build, undo: list):
    """``build`` with the model's softcaps computed in float32 (Gemma 2's modeling module); what
    it replaces in that module goes back when the callables it appends to ``undo`` are called."""
    def fp32_build(cfg, device):
        model, loss_of, vocab = build(cfg, device)
        import transformers.models.gemma2.modeling_gemma2 as gemma2

        def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      **kwargs):
            scaling = module.head_dim ** -0.5 if scaling is None else scaling
            groups = module.num_key_value_groups
            key, value = gemma2.repeat_kv(key, groups), gemma2.repeat_kv(value, groups)
            scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if attention_mask is not None:
                scores = scores + attention_mask
            probs = torch.softmax(scores, dim=-1).to(query.dtype)
            return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs

        undo.append(lambda original=gemma2.eager_attention_forward:
                    setattr(gemma2, "eager_attention_forward", original))
        gemma2.eager_attention_forward = attention
        cap = model.config.final_logit_softcapping
        if cap is not None:
            model.config.final_logit_softcapping = None
            head = model.lm_head
            head.forward = lambda x, _f=head.forward: torch.tanh(_f(x).float() / cap) * cap
        print(f"  fp32_softcap: attention and final logits (cap {cap}) in float32", flush=True)
        return model, loss_of, vocab
    return fp32_build


def main(argv: list[str]) -> int:
    model, out = argv[0], argv[1]
    runs = (argv[2] if len(argv) > 2 else "eager,d1,d2,patched,compiled").split(",")
    deterministic()
    cfg = Config(layers=12, model=model, vocab=0)
    build = training.build
    losses, undo = {}, []
    try:
        for run in runs:
            training.build = (_fp32_softcap(build, undo) if run == "fp32_softcap"
                              else _moved(build, run if run in PERTURB else None))
            t = time.time()
            try:
                r = train(cfg, steps=200, batch_size=4, patched=run == "patched", compiled=run == "compiled", seed=0)
            finally:
                while undo:
                    undo.pop()()
            losses[run] = r["losses"]
            print(f"{model} {run}: loss {r['losses'][0]:.5f} -> {r['losses'][-1]:.5f}, {time.time() - t:.0f} s",
                  flush=True)
            with open(out, "w") as f:
                json.dump(losses, f)
    finally:
        training.build = build
    base = losses.get("eager")
    for run, curve in losses.items():
        if base is None or run == "eager":
            continue
        d = [abs(a - b) for a, b in zip(base, curve)]
        print(f"{model} {run} vs eager: max {max(d):.4f}, last 20 {sum(d[-20:]) / len(d[-20:]):.4f}, "
              f"all {sum(d) / len(d):.4f}, step 0 {d[0]:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
