import sys, importlib, torch, numpy as np
import cukern
from cukern import _bench
mode = sys.argv[1]
def mk(shape, cl):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if cl: x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    return x
if mode == "ncu":
    for cl in (False, True):
        x = mk((16,512,64,64), cl); dy = mk((16,512,64,64), cl)
        w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
        y, m, r = cukern.group_norm(x, 32, w, w, return_stats=True)
        cukern.group_norm_backward(dy, x, 32, w, m, r)
        torch.cuda.synchronize()
else:
    copy = _bench.copy_bandwidth()
    print("copy", round(copy))
    for shape, g in (((16,512,64,64),32), ((64,512,32,32),8), ((256,512,16,16),2), ((16,512,64,64),512//4)):
        for cl in (False, True):
            x = mk(shape, cl); dy = mk(shape, cl)
            w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
            y, m, r = cukern.group_norm(x, g, w, w, return_stats=True)
            f = _bench.time_cuda(lambda: cukern.group_norm(x, g, w, w, return_stats=True), warmup=5, reps=30)
            b = _bench.time_cuda(lambda: cukern.group_norm_backward(dy, x, g, w, m, r), warmup=5, reps=30)
            nb = x.numel()*2
            print(shape, g, "CL" if cl else "NCHW", f"fwd {f*1e3:.1f} us {2*nb/f/1e6/copy*100:.0f}%  bwd {b*1e3:.1f} us {3*nb/b/1e6/copy*100:.0f}%")
