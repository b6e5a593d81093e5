"""Helpers for the PyTorch-path tables that each family's test module declares (its CPU
stand-ins, opcheck samples and kernel-count cases), which tests/test_torch_integration.py
discovers: a new family adds its rows in its own test module."""
from __future__ import annotations

import importlib

import torch


def recompute(fn, inputs, dy):
    """Gradients of fn(*inputs) w.r.t. its tensor inputs (None for the others) on the CPU."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                  for t in inputs]
        out = fn(*leaves)
        live = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = iter(torch.autograd.grad(out, live, dy, allow_unused=True))
        return [next(grads) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves]


def leaf(shape, dtype, seed, scale=1.0):
    """A random CUDA tensor that requires grad."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype).requires_grad_(True)


def family_tables(name: str, *args) -> list:
    """``name(*args)`` of every family's test module that defines it, in registry order."""
    from cukern import _registry

    out = []
    for f in _registry.families():
        fn = getattr(importlib.import_module(f"test_{f.name}"), name, None)
        if fn is not None:
            out.append(fn(*args))
    return out


def in_fresh_thread(fn):
    """``fn()`` run on a new thread (one that has made no CUDA call yet); its result, or the
    exception it raised re-raised here."""
    import threading

    got = {}

    def run():
        try:
            got["result"] = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below
            got["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in got:
        raise got["error"]
    return got["result"]
