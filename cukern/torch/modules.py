"""Drop-in modules: subclasses of nn.LayerNorm, nn.RMSNorm, nn.GroupNorm and nn.Embedding
with the same constructor arguments, parameters and state_dict keys (checkpoints load either
way), whose forward runs on cukern's kernels when the call is supported and on PyTorch's
otherwise (see ``cukern.torch.counts``)."""
from __future__ import annotations

from torch import Tensor, nn

from . import _functional


class LayerNorm(nn.LayerNorm):
    def forward(self, input: Tensor) -> Tensor:
        return _functional.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        return _functional.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class GroupNorm(nn.GroupNorm):
    def forward(self, input: Tensor) -> Tensor:
        return _functional.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


class Embedding(nn.Embedding):
    def forward(self, input: Tensor) -> Tensor:
        return _functional.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                                     self.scale_grad_by_freq, self.sparse)
