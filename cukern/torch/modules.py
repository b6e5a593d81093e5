"""Drop-in modules declared by the families: subclasses of nn.LayerNorm, nn.RMSNorm,
nn.GroupNorm and nn.Embedding with the same constructor arguments, parameters and state_dict
keys (checkpoints load either way), whose forward runs on cukern's kernels when the call is
supported and on PyTorch's otherwise (see ``cukern.torch.counts``)."""
from __future__ import annotations

from torch import nn

from .._registry import families
from . import _tools
from ._functional import DROPINS
from ._ops import OPS


def _module(spec) -> type:
    fn, args, options, variant = DROPINS[spec.functional], spec.args, dict(spec.options), spec.variant
    base = getattr(nn, spec.base)

    def __init__(self, *a, **kw):
        own = {k: kw.pop(k, v) for k, v in options.items()}
        base.__init__(self, *a, **kw)
        for k, v in own.items():
            setattr(self, k, v)
        self._variant = any(own[k] != v for k, v in options.items())
        if self._variant and spec.init is not None:
            spec.init(self)

    def forward(self, input):
        return fn(*args(self, input))

    def forward_with_options(self, input):
        if self._variant:
            return variant(_tools, OPS, self, input)
        return fn(*args(self, input))

    def extra_repr(self):
        rest = "".join(f", {k}={getattr(self, k)!r}" for k, v in options.items() if getattr(self, k) != v)
        return base.extra_repr(self) + rest

    extra = (f" Also takes, keyword-only: {', '.join(f'{k}={v!r}' for k, v in options.items())} "
             f"(see the family's docs).") if options else ""
    body = {"forward": forward, "__module__": __name__,
            "__doc__": f"``torch.nn.{spec.base}`` whose forward calls ``cukern.torch.{spec.functional}``: "
                       f"the same constructor, parameters and state_dict.{extra}"}
    if options:
        body.update(__init__=__init__, extra_repr=extra_repr, forward=forward_with_options)
    return type(spec.name, (base,), body)


MODULES: dict[str, type] = {spec.name: _module(spec) for f in families() for spec in f.modules}
globals().update(MODULES)
__all__ = list(MODULES)
