"""cukern inside PyTorch: custom ops (``torch.ops.cukern.*``, autograd and torch.compile),
drop-in functions and modules, and ``patch()`` to route an unchanged model's calls.

    import cukern.torch
    model = transformers.LlamaForCausalLM(config)     # or GPT-2, Mistral: their code unchanged
    cukern.torch.patch(model)           # its norms, RoPE, MLP, attention, embedding and loss

    with cukern.torch.patch():          # or cukern.torch.patch() ... cukern.torch.unpatch()
        loss = model(tokens).loss       # F.layer_norm, F.rms_norm, F.group_norm, F.embedding,
        loss.backward()                 # F.scaled_dot_product_attention, F.cross_entropy -> cukern
    print(cukern.torch.counts())        # {"layer_norm": {"cukern": 48, "torch": 0}, ...}
    print(cukern.torch.routing(model))  # {"model.norm": "norm: RMSNorm, casting llama", ...}

    loss = cukern.torch.linear_cross_entropy(hidden, lm_head.weight, targets)   # no (T, V) logits

Needs torch (a CUDA build for the kernels; on other tensors everything falls back). The
functions, ops and modules are those the kernel families declare (cukern._registry).
"""
from ._api import api as _api
from ._functional import DROPINS as _DROPINS, counts, reset_counts
from ._models import PARTS, decisions as routing
from ._patch import OPS, is_patched, patch, unpatch
from .modules import MODULES as _MODULES

# the families' own functions and modules (linear_cross_entropy, ...)
_API = _api()

globals().update(_DROPINS)
globals().update(_MODULES)
globals().update(_API)

__all__ = ["OPS", "PARTS", "patch", "unpatch", "is_patched", "routing", "counts", "reset_counts", *_DROPINS, *_MODULES,
           *_API]
