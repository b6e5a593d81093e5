"""Mixture-of-experts: routing, token permutation and grouped expert products.

Where each job lives:
    reference.py  the NumPy references (float64), forward and backward: the router (softmax or
                  sigmoid top-k, renormalized), the load-balancing and router z-losses, the
                  permutation of tokens by expert and the weighted combine back, grouped matrix
                  products over expert groups, and the whole MoE block as transformers' Mixtral
                  computes it.
    routing.py    the router and the token permutation on the kernels (cuda_src/moe.cu): array
                  functions with their launch plans, forward and backward, no host
                  synchronization (``moe_router``, ``moe_permute``, ``moe_unpermute``, their
                  backwards).
    grouped_mm.py the grouped expert products on tensor cores (cuda_src/moe_grouped_mm.cu on
                  mma.sync, cuda_src/moe_grouped_mm_sm90.cu on Hopper's TMA and wgmma): each
                  expert's rows times its weight (held (E, N, K) or (E, K, N)), and both
                  backward products, the groups' sizes read on the device (``moe_grouped_mm``,
                  ``moe_grouped_mm_backward``).
    biased_glu.py GPT-OSS's biased experts around the grouped products (cuda_src/moe_biased_glu.cu):
                  the clamped gate with the up projection's bias and its backward, a bias added
                  to each expert's rows, each expert's rows summed (the biases' gradients).

    block.py      the MoE block as one call composed of those kernels: ``moe_forward`` (the
                  output and what the backward needs) and ``moe_backward``.
    torch.py      the family's ops under PyTorch, declared below as TorchOps: ``moe_experts``
                  (transformers' fused experts: ``cukern.torch.moe_experts``, what
                  ``cukern.torch.patch(model)`` routes a model's experts to),
                  ``moe_experts_biased`` (GPT-OSS's) and ``moe_block``
                  (the block, router included: ``cukern.torch.moe_block``), their forwards,
                  backwards and shapes.

    bench.py      the benchmark cases (the grouped products against ``torch._grouped_mm``; the
                  experts against PyTorch's grouped products, Liger-Kernel and transformers).
"""
from .._family import Family, TorchOp
from . import biased_glu as _biased_glu
from . import block as _block
from . import grouped_mm as _grouped_mm
from . import routing as _routing
from .bench import bench_cases as _bench_cases
from .bench import torch_bench_cases as _torch_bench_cases


def instances() -> list:
    """Every kernel instance of the family (routing's and the grouped products')."""
    return _routing.instances() + _grouped_mm.instances() + _biased_glu.instances()


def _impl():
    from . import torch as impl   # (torch is imported when an op first runs)

    return impl


TORCH_OPS = (
    TorchOp("moe_experts",
            "(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor w_gate_up, Tensor w_down, int act) -> "
            "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
            forward=lambda *a: _impl().experts_forward(*a),
            inference=lambda *a: _impl().experts_forward(*a)[0],
            fake=lambda *a: _impl().experts_fake(*a),
            # (saved: x_perm, row_of, offsets, h, y, the float32 weights, and both projections; the
            # gate's output is computed again from h)
            save=lambda inputs, outputs: ((*outputs[1:], inputs[3], inputs[4]), (inputs[5], inputs[1].shape[1])),
            backward_schema="(Tensor dout, Tensor x_perm, Tensor row_of, Tensor offsets, Tensor h, "
                            "Tensor y, Tensor weights, Tensor w_gate_up, Tensor w_down, int act, int top_k) -> "
                            "(Tensor, Tensor, Tensor, Tensor)",
            backward=lambda *a: _impl().experts_backward(*a),
            backward_fake=lambda *a: _impl().experts_backward_fake(*a),
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state),
            grads_to=(0, 2, 3, 4)),
    TorchOp("moe_experts_biased",
            "(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor w_gate_up, Tensor b_gate_up, "
            "Tensor w_down, Tensor b_down, float alpha, float limit) -> "
            "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
            forward=lambda *a: _impl().biased_experts_forward(*a),
            inference=lambda *a: _impl().biased_experts_forward(*a)[0],
            fake=lambda *a: _impl().biased_experts_fake(*a),
            # (saved: x_perm, row_of, offsets, h, y, the float32 weights, both weights and biases; the
            # gate's output is computed again from h)
            save=lambda inputs, outputs: ((*outputs[1:], *inputs[3:7]), (inputs[7], inputs[8], inputs[1].shape[1])),
            backward_schema="(Tensor dout, Tensor x_perm, Tensor row_of, Tensor offsets, Tensor h, "
                            "Tensor y, Tensor weights, Tensor w_gate_up, Tensor b_gate_up, Tensor w_down, "
                            "Tensor b_down, float alpha, float limit, int top_k) -> "
                            "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
            backward=lambda *a: _impl().biased_experts_backward(*a),
            backward_fake=lambda *a: _impl().biased_experts_backward_fake(*a),
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state),
            grads_to=(0, 2, 3, 4, 5, 6)),
    TorchOp("moe_block",
            "(Tensor x, Tensor router_w, Tensor w_gate_up, Tensor w_down, Tensor? selection_bias, int top_k, "
            "int act, int score, bool renormalize, float scale) -> "
            "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
            forward=lambda *a: _impl().block_forward(*a),
            fake=lambda *a: _impl().block_fake(*a),
            # (visible: the output and the logits, whose gradient (the auxiliary losses') joins the
            # router's; saved: the inputs, the logits and the rest of what the forward keeps)
            save=lambda inputs, outputs: ((*inputs[:4], *outputs[1:]), tuple(inputs[5:])),
            backward_schema="(Tensor dout, Tensor? dlogits, Tensor x, Tensor router_w, Tensor w_gate_up, "
                            "Tensor w_down, Tensor logits, Tensor weights, Tensor experts, Tensor x_perm, "
                            "Tensor row_of, Tensor offsets, Tensor h, Tensor y, int top_k, int act, "
                            "int score, bool renormalize, float scale) -> (Tensor, Tensor, Tensor, Tensor)",
            backward=lambda *a: _impl().block_backward(*a),
            backward_fake=lambda *a: _impl().block_backward_fake(*a),
            backward_args=lambda saved, state, grads, T: (grads[0], grads[1], *saved, *state),
            grads_to=(0, 1, 2, 3), visible=2),
)


def _torch_api(T, ops, modules) -> dict:
    """``cukern.torch.moe_experts`` (transformers' fused experts) and ``cukern.torch.moe_block``
    (the block, router included) on the kernels, with autograd (the custom ops inside
    torch.compile)."""
    op = ops["moe_experts"]

    def moe_experts(x, top_k_index, top_k_weights, w_gate_up, w_down, act: str = "silu"):
        """transformers' fused experts on the kernels, with autograd.

        Args:
            x: (T, H) float16 or bfloat16 CUDA tensor: the tokens.
            top_k_index: (T, k) integer: each token's experts (the model's router's choice).
            top_k_weights: (T, k) float: their weights (the gradient flows back to the router).
            w_gate_up: (E, 2I, H), x's dtype: each expert's gate rows then up rows.
            w_down: (E, H, I), x's dtype.
            act: "silu", "gelu" or "gelu_tanh" on the gate half.

        Returns:
            (T, H) in x's dtype: each token's experts' outputs times their weights, summed in
            float32.
        """
        code = _block.ACTS.index(_block._act(act))
        args = (x, top_k_index, top_k_weights, w_gate_up, w_down, code)
        return op.compiled(*args) if T.compiling() else op(*args)

    biased_op = ops["moe_experts_biased"]

    def moe_experts_biased(x, top_k_index, top_k_weights, w_gate_up, b_gate_up, w_down, b_down, alpha: float = 1.702,
                           limit: float = 7.0):
        """GPT-OSS's experts on the kernels, with autograd: for each token's k experts e,
        ``h = x @ w_gate_up[e] + b_gate_up[e]``; gate ``g = min(h[0::2], limit)``, up ``u =
        clamp(h[1::2], -limit, limit)``; ``z = (u + 1) * g * sigmoid(alpha * g)``; the sum of
        ``top_k_weights`` times ``z @ w_down[e] + b_down[e]``. The products on the grouped
        kernels (weights read (E, in, out)); the biases and the gate in float32 PyTorch ops.

        Args:
            x: (T, H) float16 or bfloat16 CUDA tensor. top_k_index: (T, k) integer; top_k_weights:
                (T, k) float. w_gate_up: (E, H, 2I), x's dtype, gate and up columns interleaved;
                b_gate_up: (E, 2I) float32 or x's dtype; w_down: (E, I, H), x's dtype; b_down: (E, H).
            alpha, limit: the gate's slope and clamp (GPT-OSS: 1.702 and 7.0).

        Returns:
            (T, H) in x's dtype (each expert's output, bias included, rounded to it once, then
            the weighted sum in float32).
        """
        if not T.compiling():
            _impl().check_biased_experts(x, top_k_index, top_k_weights, w_gate_up, b_gate_up, w_down, b_down, alpha,
                                         limit)
        args = (x, top_k_index, top_k_weights, w_gate_up, b_gate_up, w_down, b_down, float(alpha), float(limit))
        return biased_op.compiled(*args) if T.compiling() else biased_op(*args)

    block_op = ops["moe_block"]

    def moe_block(x, router_w, w_gate_up, w_down, top_k: int, *, act: str = "silu", score: str = "softmax",
                  renormalize: bool = True, selection_bias=None, scale: float = 1.0):
        """The MoE block as one op (``cukern.moe_forward`` / ``moe_backward`` under autograd; the
        custom op ``torch.ops.cukern.moe_block`` inside torch.compile): the router's logits
        ``x @ router_w.T``, each token's ``top_k`` experts (softmax or sigmoid scores, renormalized
        where asked, times ``scale``; ``selection_bias`` (E,) float32 shifts the choice alone),
        the experts' gated MLPs and the weighted sum, with no host synchronization.

        Args:
            x: (T, H) float16 or bfloat16 CUDA tensor. router_w: (E, H); w_gate_up: (E, 2I, H),
                the gate's rows first; w_down: (E, H, I); all of x's dtype. Under CUDA autocast
                all four are cast to autocast's dtype first, as its F.linear casts its inputs
                (float32 parameters then get float32 gradients through the cast).
            top_k: experts a token. act: "silu", "gelu" or "gelu_tanh". score: "softmax" or
                "sigmoid".

        Returns:
            (out (T, H), logits (T, E)), both in x's dtype (autocast's under autocast). The
            logits are for the auxiliary losses (``cukern.moe.reference`` has their forms):
            their gradient reaches x and router_w through the router's product; the choice of
            experts is held fixed.
        """
        import torch

        from .reference import SCORES

        if score not in SCORES:
            raise ValueError(f"score: expected one of {SCORES}, got {score!r}")
        if torch.is_autocast_enabled("cuda"):
            dt = torch.get_autocast_dtype("cuda")
            x, router_w, w_gate_up, w_down = (t.to(dt) for t in (x, router_w, w_gate_up, w_down))
        args = (x, router_w, w_gate_up, w_down, selection_bias, int(top_k), _block.ACTS.index(_block._act(act)),
                SCORES.index(score), bool(renormalize), float(scale))
        out = block_op.compiled(*args) if T.compiling() else block_op(*args)
        return tuple(out)

    return {"moe_experts": moe_experts, "moe_experts_biased": moe_experts_biased, "moe_block": moe_block}


FAMILY = Family(
    name="moe",
    api=(_routing.moe_router, _routing.moe_router_backward, _routing.moe_permute, _routing.moe_permute_backward,
         _routing.moe_unpermute, _routing.moe_unpermute_backward, _grouped_mm.moe_grouped_mm,
         _grouped_mm.moe_grouped_mm_backward, _block.moe_forward, _block.moe_backward),
    # (the references, cukern.moe.reference, return what the tests compare, not every output of
    # the fronts of the same names; cukern.reference takes them when their signatures agree)
    references={},
    instances=instances,
    bench=_bench_cases,
    torch_bench=_torch_bench_cases,
    torch_ops=TORCH_OPS,
    torch_api=_torch_api,
)
