"""Attention's rounding errors against a float64 reference, beside PyTorch's SDPA in the same dtype.

For float16 and bfloat16 and a handful of shapes (head dims 64, 128 and 256, causal and not,
GQA, a sliding window, the softcap), the forward's out and lse and the backward's dq, dk, dv of
cukern.attention / cukern.attention_backward, and of torch's scaled_dot_product_attention on
its FLASH_ATTENTION and CUDNN_ATTENTION backends, each against attention computed in float64 on
the GPU (explicit math, autograd for the gradients) from the same rounded inputs. Two figures
each: the relative L2 error ||x - ref|| / ||ref|| and the largest element error
max |x - ref| / (|ref| + rms(ref)) (the form of the tests' element-wise bound, tests/arrays.py).
lse: the largest absolute error. A backend that refuses a case (or has no softcap) prints "n/a".

    python3 tools/probe_attention_error.py            # on a CUDA machine with torch and CuPy
"""
import math
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cukern

NONE = (-1, -1)
# (case, batch, seqlen, heads, kv_heads, head_dim, causal, window, softcap, std of q and k)
CASES = [
    ("d64", 2, 1024, 8, 8, 64, False, NONE, 0.0, 1.0),
    ("d64 causal", 2, 2048, 8, 8, 64, True, NONE, 0.0, 1.0),
    ("d128", 2, 1000, 8, 8, 128, False, NONE, 0.0, 1.0),
    ("d128 causal", 2, 2048, 8, 8, 128, True, NONE, 0.0, 1.0),
    ("d256", 1, 777, 8, 8, 256, False, NONE, 0.0, 1.0),
    ("d256 causal", 1, 1536, 8, 8, 256, True, NONE, 0.0, 1.0),
    ("d128 GQA 16/4 causal", 1, 2048, 16, 4, 128, True, NONE, 0.0, 1.0),
    ("d128 causal window (256, 0)", 1, 2048, 8, 8, 128, True, (256, 0), 0.0, 1.0),
    ("d128 causal softcap 5, q k std 2", 1, 2048, 8, 8, 128, True, NONE, 5.0, 2.0),
]
DTYPES = (("bf16", torch.bfloat16), ("fp16", torch.float16))
PEERS = (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION))


def visible(sq, sk, causal, window, device):
    """(sq, sk) bool, query i sees key j (bottom-right aligned, as cukern), or None: every key."""
    left, right = window
    right = 0 if causal else right
    if left < 0 and right < 0:
        return None
    pos = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= pos + right
    if left >= 0:
        keep &= j >= pos - left
    return keep


def reference(q, k, v, do, scale, keep, softcap):
    """float64 out (B, S, H, D), lse (B, H, S), dq, dk, dv from the rounded (B, S, H, D) inputs."""
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    s = q64 @ k64.repeat_interleave(rep, 1).transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v64.repeat_interleave(rep, 1)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), do.double().transpose(1, 2))
    return [t.detach().transpose(1, 2) for t in (out, dq, dk, dv)] + [lse.detach()]


def ours(q, k, v, do, scale, causal, window, softcap):
    kw = dict(causal=causal, softmax_scale=scale, window=window, softcap=softcap)
    out, lse = cukern.attention(q, k, v, return_lse=True, **kw)
    return [out, *cukern.attention_backward(do, q, k, v, out, lse, **kw), lse]


def sdpa(q, k, v, do, scale, causal, mask, backend):
    """torch's SDPA on one backend, (B, S, H, D) results; raises where the backend refuses."""
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    with sdpa_kernel(backend), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None,
                                           scale=scale, enable_gqa=gqa)
        grads = torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2).contiguous())
    return [t.detach().transpose(1, 2) for t in (o, *grads)] + [None]


def errors(got, ref):
    """(relative L2, max element error) of each of out, dq, dk, dv; then lse's max abs error."""
    figs = []
    for x, r in zip(got[:4], ref[:4]):
        d = x.double() - r
        rms = r.pow(2).mean().sqrt()
        figs.append((float(d.norm() / r.norm()), float((d.abs() / (r.abs() + rms)).max())))
    lse_err = None if got[4] is None else float((got[4].double() - ref[4]).abs().max())
    return figs, lse_err


def main():
    if not torch.cuda.is_available():
        sys.exit("probe_attention_error: needs a CUDA device")
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cukern {cukern.__version__}", flush=True)
    rows = []
    for ci, (name, B, S, H, Hkv, D, causal, window, softcap, std) in enumerate(CASES):
        for dname, dtype in DTYPES:
            g = torch.Generator(device=dev).manual_seed(1000 + ci)
            q = (torch.randn(B, S, H, D, device=dev, generator=g) * std).to(dtype)
            k = (torch.randn(B, S, Hkv, D, device=dev, generator=g) * std).to(dtype)
            v = torch.randn(B, S, Hkv, D, device=dev, generator=g).to(dtype)
            do = torch.randn(B, S, H, D, device=dev, generator=g).to(dtype)
            scale = 1.0 / math.sqrt(D)
            keep = visible(S, S, causal, window, dev)
            mask = keep if window != NONE else None   # (SDPA: a causal mask alone as is_causal)
            ref = reference(q, k, v, do, scale, keep, softcap)
            runs = [("cukern", lambda: ours(q, k, v, do, scale, causal, window, softcap))]
            for pname, backend in PEERS:   # (SDPA has no softcap)
                runs.append((pname, None if softcap else
                             (lambda b=backend: sdpa(q, k, v, do, scale, causal, mask, b))))
            for impl, fn in runs:
                try:
                    res = errors(fn(), ref) if fn is not None else None
                except RuntimeError as e:   # (a backend that does not take the case)
                    print(f"  {name} {dname} {impl}: refused ({str(e).splitlines()[0][:100]})", flush=True)
                    res = None
                rows.append((name, dname, impl, res))
                if res is not None:
                    print(f"  {name} {dname} {impl}: out {res[0][0][0]:.2e} dq {res[0][1][0]:.2e} "
                          f"dk {res[0][2][0]:.2e} dv {res[0][3][0]:.2e}", flush=True)
            del ref
            torch.cuda.empty_cache()
    print("\nrelative L2 error / largest element error, against float64 (lse: largest absolute error)\n")
    print("| case | dtype | impl | out | dq | dk | dv | lse |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, dname, impl, res in rows:
        if res is None:
            cells = ["n/a"] * 5
        else:
            cells = [f"{l2:.1e} / {mx:.1e}" for l2, mx in res[0]] + ["n/a" if res[1] is None else f"{res[1]:.1e}"]
        print(f"| {name} | {dname} | {impl} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
