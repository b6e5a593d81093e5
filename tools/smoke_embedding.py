"""Quick GPU check of the embedding ops against torch (no hypothesis): prints max errors."""
import numpy as np
import torch
import torch.nn.functional as F

import cukern

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for V, D, T, dist, pad, freq in [(1000, 64, 5000, "uniform", None, False), (50, 4099, 3000, "same", None, False),
                                     (5000, 1024, 20000, "zipf", 3, True), (7, 9, 100, "uniform", -1, True),
                                     (128256, 4096, 8192, "zipf", None, False)]:
        if dist == "uniform":
            idx = torch.randint(0, V, (T,), device="cuda")
        elif dist == "same":
            idx = torch.full((T,), V // 2, device="cuda")
        else:
            idx = torch.from_numpy(np.random.default_rng(0).zipf(1.2, T) % V).cuda()
        w = torch.randn(V, D, device="cuda", dtype=dtype, requires_grad=True)
        dy = torch.randn(T, D, device="cuda", dtype=dtype)
        y_t = F.embedding(idx, w, padding_idx=pad, scale_grad_by_freq=freq)
        (dw_t,) = torch.autograd.grad(y_t, (w,), dy)
        y = cukern.embedding(idx, w.detach(), pad)
        dw = cukern.embedding_backward(dy, idx, V, pad, freq)
        dw2 = cukern.embedding_backward(dy, idx, V, pad, freq)
        # float64 reference
        ref = torch.zeros(V, D, dtype=torch.float64, device="cuda")
        ref.index_add_(0, idx, dy.double())
        if freq:
            cnt = torch.bincount(idx, minlength=V).double().clamp(min=1)
            ref /= cnt[:, None]
        if pad is not None:
            ref[pad % V] = 0
        e = ((dw.double() - ref).norm() / ref.norm()).item()
        et = ((dw_t.double() - ref).norm() / ref.norm()).item()
        print(f"{str(dtype):15s} V={V} D={D} T={T} {dist:7s} pad={pad} freq={freq}: fwd equal {torch.equal(y, y_t)}, "
              f"bwd rel err {e:.2e} (torch {et:.2e}), deterministic {torch.equal(dw, dw2)}")
bad = torch.tensor([1, -3, 5, 10**6], device="cuda")
w = torch.randn(10, 8, device="cuda")
y = cukern.embedding(bad, w)
print("out-of-range fwd rows zero:", bool((y[1] == 0).all() and (y[3] == 0).all()), "row0 ok:", torch.equal(y[0], w[1]))
try:
    cukern.check_errors()
    print("check_errors did NOT raise")
except IndexError as e:
    print("check_errors raised:", e)
cukern.check_errors()
print("second check passes")
