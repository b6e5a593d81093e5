"""Drop-in modules declared by the families: subclasses of nn.LayerNorm, nn.RMSNorm,
nn.GroupNorm and nn.Embedding with the same constructor arguments, parameters and state_dict
keys (checkpoints load either way), whose forward runs on cukern's kernels when the call is
supported and on PyTorch's otherwise (see ``cukern.torch.counts``)."""
from __future__ import annotations

from torch import nn

from .._registry import families
from ._functional import DROPINS


def _module(spec) -> type:
    fn, args = DROPINS[spec.functional], spec.args

    def forward(self, input):
        return fn(*args(self, input))

    base = getattr(nn, spec.base)
    return type(spec.name, (base,), {
        "forward": forward, "__module__": __name__,
        "__doc__": f"``torch.nn.{spec.base}`` whose forward calls ``cukern.torch.{spec.functional}``: "
                   f"the same constructor, parameters and state_dict."})


MODULES: dict[str, type] = {spec.name: _module(spec) for f in families() for spec in f.modules}
globals().update(MODULES)
__all__ = list(MODULES)
