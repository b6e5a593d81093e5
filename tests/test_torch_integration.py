"""cukern.torch: custom ops (opcheck, autograd, torch.compile), drop-in functions and modules,
patch()/unpatch() and its fallbacks, autocast, gradient accumulation, the training demo, and
DistributedDataParallel. The routing and fallback logic runs on the CPU (CI); the rest on a GPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cukern.torch as ct  # noqa: E402
from cukern import demo  # noqa: E402
from cukern.torch import _functional, _tools  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
ORIG = _functional.ORIGINAL
NAMES = ("layer_norm", "rms_norm", "group_norm", "embedding", "scaled_dot_product_attention")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """No patch left behind, and every call routed whatever its size (the tests' tensors are
    small; test_small_calls_stay_with_pytorch checks the thresholds themselves)."""
    ct.reset_counts()
    for name in _tools.MIN_SIZE:
        monkeypatch.setitem(_tools.MIN_SIZE, name, 0)
    yield
    while ct.is_patched():
        ct.unpatch()


# ---- CPU: routing, fallbacks, modules ------------------------------------------------------

def test_patch_as_function_and_context_manager_and_nested():
    assert not ct.is_patched() and all(getattr(F, n) is ORIG[n] for n in NAMES)
    ct.patch()
    assert all(getattr(F, n) is getattr(ct, n) for n in NAMES)
    with ct.patch():   # nested: the inner exit leaves the outer patch in place
        assert F.layer_norm is ct.layer_norm
    assert F.layer_norm is ct.layer_norm
    ct.unpatch()
    assert all(getattr(F, n) is ORIG[n] for n in NAMES)
    ct.unpatch()   # an extra unpatch is harmless
    with ct.patch():
        assert nn.LayerNorm(8)(torch.ones(2, 8)).shape == (2, 8)
    assert F.scaled_dot_product_attention is ORIG["scaled_dot_product_attention"]


def test_patch_a_subset_of_the_functions():
    with ct.patch(ops=("layer_norm", "embedding")):
        assert F.layer_norm is ct.layer_norm and F.embedding is ct.embedding
        assert F.scaled_dot_product_attention is ORIG["scaled_dot_product_attention"]
    assert F.layer_norm is ORIG["layer_norm"] and F.embedding is ORIG["embedding"]
    with pytest.raises(ValueError, match="ops: unknown"):
        ct.patch(ops=("softmax",))
    assert not ct.is_patched()


def test_patch_is_undone_when_the_block_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with ct.patch():
            raise RuntimeError("boom")
    assert not ct.is_patched() and F.embedding is ORIG["embedding"]


def test_cpu_tensors_fall_back_to_pytorch_with_identical_results():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 8, generator=g)
    w, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    xg = torch.randn(2, 4, 3, 5, generator=g)
    idx = torch.randint(0, 10, (3, 4), generator=g)
    table = torch.randn(10, 8, generator=g)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    with ct.patch():
        got = [F.layer_norm(x, (8,), w, b), F.rms_norm(x, (8,), w), F.group_norm(xg, 2),
               F.embedding(idx, table, padding_idx=1), F.scaled_dot_product_attention(q, k, v, is_causal=True)]
    expect = [ORIG["layer_norm"](x, (8,), w, b), ORIG["rms_norm"](x, (8,), w), ORIG["group_norm"](xg, 2),
              ORIG["embedding"](idx, table, padding_idx=1),
              ORIG["scaled_dot_product_attention"](q, k, v, is_causal=True)]
    for a, e in zip(got, expect):
        assert torch.equal(a, e)
    c = ct.counts(reasons=True)
    for n in NAMES:
        assert c[n]["cukern"] == 0 and c[n]["torch"] == 1 and sum(c[n]["torch_reasons"].values()) == 1
    ct.reset_counts()
    assert ct.counts() == {}


@pytest.mark.parametrize("cls, args", [(nn.LayerNorm, (16,)), (nn.RMSNorm, (16,)), (nn.GroupNorm, (4, 16)),
                                       (nn.Embedding, (30, 16))])
def test_modules_are_drop_ins_with_the_same_state_dict(cls, args):
    ours = getattr(ct, cls.__name__)(*args)
    theirs = cls(*args)
    assert isinstance(ours, cls)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    with torch.no_grad():
        for p in theirs.parameters():
            p.uniform_(-1, 1)
    ours.load_state_dict(theirs.state_dict())   # checkpoints load either way
    theirs.load_state_dict(ours.state_dict())
    x = torch.randint(0, 30, (3, 5)) if cls is nn.Embedding else torch.randn(3, 16, 5).transpose(1, 2)
    if cls is nn.GroupNorm:
        x = torch.randn(3, 16, 5)
    assert torch.equal(ours(x), theirs(x))   # on the CPU: PyTorch's own computation


def test_demo_model_runs_on_the_cpu_and_categories():
    cfg = demo.Config(layers=2, dim=32, heads=2, vocab=50, seq=16)
    model = demo.GPT(cfg)
    tokens, targets = demo.batch(torch.Generator().manual_seed(0), 2, cfg.seq, cfg.vocab, "cpu")
    assert tokens.shape == targets.shape == (2, 16) and torch.equal(tokens[:, 1:], targets[:, :-1])
    with ct.patch():
        loss = model(tokens, targets)
    loss.backward()
    assert 3.0 < loss.item() < 5.0   # about ln(50) at initialization
    assert demo.category("sm90_xmma_gemm_bf16bf16_bf16f32") == "matrix multiply"
    assert demo.category("void attention_bwd_dkdv<cuk::bf16, 128>") == "attention"
    assert demo.category("pytorch_flash::flash_fwd_kernel") == "attention"
    assert demo.category("void norm_fwd<cuk::bf16>") == "normalization"
    assert demo.category("void sum_partial_rows<float>") == "normalization"
    assert demo.category("void at::native::GammaBetaBackwardCUDAKernelTemplate<float>") == "normalization"
    assert demo.category("void at::native::vectorized_layer_norm_kernel<float>") == "normalization"
    assert demo.category("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>") == "attention"
    assert demo.category("void at::native::multi_tensor_apply_kernel<LpNormFunctor<float>>") == "elementwise"
    assert demo.category("embedding_bwd_chunks") == "embedding"
    assert demo.category("ncclDevKernel_AllReduce_Sum_f32") == "communication"
    assert demo.category("void at::native::vectorized_elementwise_kernel<4>") == "elementwise"
    assert demo.category("void cross_entropy_rows<cuk::bf16, long long, 8, 512, 1>") == "loss"
    assert demo.category("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>") == "loss"
    assert demo.category("void at::native::nll_loss_forward_reduce_cuda_kernel_2d<float>") == "loss"
    assert demo.category("something_else") == "other"
    top = demo.format_top({"void norm_fwd<float>": 1.0, "ampere_gemm": 3.0, "x": 0.5}, 2, "t").splitlines()
    assert len(top) == 3 and "ampere_gemm" in top[1] and "66.7%" in top[1] and "normalization" in top[2]


def test_demo_deterministic_turns_on_pytorchs_deterministic_algorithms(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        demo.deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")   # a value the user set stays
        demo.deterministic()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before)


def test_demo_batches_repeat_a_pattern_and_need_no_host_sync():
    gen = torch.Generator().manual_seed(5)
    tokens, _ = demo.batch(gen, 3, 300, 1000, "cpu")
    periods = set()
    for row in tokens:   # one period in 16..64 explains most positions (5% noise), the others few
        match = sorted((float((row[p:] == row[:-p]).float().mean()), p) for p in range(16, 65))
        assert match[-1][0] >= 0.75 and match[-2][0] < 0.3
        periods.add(match[-1][1])
    assert len(periods) == 1
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 1000


def _cpu_stand_ins():
    """Each family's TorchOp with its array functions replaced by PyTorch CPU computations (the
    families' test modules declare them: ``torch_stand_ins()``): the op's own save /
    backward_args / grads_to wiring is what is tested, through the same eager autograd.Function
    the drop-ins use."""
    import dataclasses

    from torch_helpers import family_tables

    from cukern import _registry
    from cukern.torch import _ops

    fake = {k: v for table in family_tables("torch_stand_ins") for k, v in table.items()}
    out = {}
    for family in _registry.families():
        for spec in family.torch_ops:
            assert spec.name in fake, f"{spec.name}: its family's test module declares no torch_stand_ins() row"
            fwd, bwd = fake[spec.name]
            stand_in = dataclasses.replace(spec, forward=fwd, backward=bwd, inference=None, donating_backward=None)
            out[spec.name] = _ops._function(stand_in, _ops._arity(spec.schema))
    return out


def test_every_family_with_torch_ops_declares_its_rows_of_the_shared_tests():
    """A family's PyTorch-path rows live in its own test module (tests/test_<family>.py), so a
    new family edits no shared test: stand-ins and wiring calls (CPU), opcheck samples (GPU)."""
    import importlib

    from cukern import _registry

    for f in _registry.families():
        if f.torch_ops:
            mod = importlib.import_module(f"test_{f.name}")
            for name in ("torch_stand_ins", "torch_wiring_calls", "opcheck_samples"):
                assert callable(getattr(mod, name, None)), f"tests/test_{f.name}.py: no {name}()"


@pytest.mark.parametrize("which", ["x", "w", "both"])
def test_each_ops_autograd_wiring_routes_every_gradient_to_its_input(which):
    from torch_helpers import family_tables

    fns = _cpu_stand_ins()
    g = torch.Generator().manual_seed(0)
    calls = [c for table in family_tables("torch_wiring_calls", which, g) for c in table]
    assert {c[0] for c in calls} == set(fns), "a family's op has no stand-in here"
    for name, args, ref, inputs in calls:
        live = [t for t in inputs if t.requires_grad]
        out, expect = fns[name].apply(*args), ref()
        out = out[0] if isinstance(out, tuple) else out   # (an op whose statistics are visible: the output)
        torch.testing.assert_close(out, expect)
        if not live:
            continue
        dy = torch.randn(out.shape, generator=g)
        for a, e in zip(torch.autograd.grad(out, live, dy), torch.autograd.grad(expect, live, dy)):
            torch.testing.assert_close(a, e, msg=name)


def test_patch_min_size_sets_the_thresholds_and_unpatch_restores_them():
    from cukern.torch._functional import DEFAULT_MIN_SIZE

    for name in _tools.MIN_SIZE:    # (the autouse fixture zeroed them for the other tests)
        _tools.MIN_SIZE[name] = DEFAULT_MIN_SIZE[name]
    assert DEFAULT_MIN_SIZE["layer_norm"] > 0 and DEFAULT_MIN_SIZE["scaled_dot_product_attention"] > 0
    with ct.patch(min_size=0):
        assert set(_tools.MIN_SIZE.values()) == {0}
        with ct.patch(min_size=5):   # nested: the outermost decides
            assert set(_tools.MIN_SIZE.values()) == {0}
    assert _tools.MIN_SIZE == DEFAULT_MIN_SIZE
    with ct.patch(min_size={"layer_norm": 7}):
        assert _tools.MIN_SIZE["layer_norm"] == 7 and _tools.MIN_SIZE["embedding"] == DEFAULT_MIN_SIZE["embedding"]
    assert _tools.MIN_SIZE == DEFAULT_MIN_SIZE
    with pytest.raises(TypeError, match="^min_size"):
        ct.patch(min_size="big")
    assert not ct.is_patched()


def test_drop_ins_keep_pytorchs_signatures():
    import inspect

    for name in ct.OPS:
        try:
            expect = inspect.signature(ORIG[name])
        except ValueError:   # a builtin (scaled_dot_product_attention): nothing to compare
            continue
        assert inspect.signature(getattr(ct, name)) == expect, name


# ---- GPU: numerics against PyTorch, autocast, fallbacks -------------------------------------

def _close(a, b, dtype):
    tol = {torch.float32: (2e-4, 2e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol[0], atol=tol[1])


def _grads(fn, *inputs):
    """(output, grads of inputs that require grad) with a random upstream gradient."""
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(1), device=out.device,
                    dtype=out.dtype)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return out, torch.autograd.grad(out, leaves, g)


def _leaf(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype).requires_grad_(True)


FN_CASES = {
    "layer_norm": lambda dt: ((_leaf((4, 50, 96), dt, 0), (96,), _leaf((96,), dt, 1), _leaf((96,), dt, 2), 1e-5),
                              lambda F_, x, s, w, b, e: F_.layer_norm(x, s, w, b, e)),
    "layer_norm_2d_shape": lambda dt: ((_leaf((4, 6, 8, 12), dt, 0), (8, 12), _leaf((8, 12), dt, 1), None, 1e-5),
                                       lambda F_, x, s, w, b, e: F_.layer_norm(x, s, w, b, e)),
    "rms_norm": lambda dt: ((_leaf((4, 50, 96), dt, 0, 0.01), (96,), _leaf((96,), dt, 1)),
                            lambda F_, x, s, w: F_.rms_norm(x, s, w)),   # eps=None matters at this scale
    "group_norm": lambda dt: ((_leaf((3, 16, 7, 5), dt, 0), 4, _leaf((16,), dt, 1), _leaf((16,), dt, 2)),
                              lambda F_, x, g, w, b: F_.group_norm(x, g, w, b)),
    "group_norm_channels_last": lambda dt: (
        (_leaf((3, 16, 7, 5), dt, 0).detach().to(memory_format=torch.channels_last).requires_grad_(True), 4,
         _leaf((16,), dt, 1), None), lambda F_, x, g, w, b: F_.group_norm(x, g, w, b)),
    "embedding": lambda dt: ((torch.randint(0, 40, (5, 9), device="cuda"), _leaf((40, 64), dt, 0), 3),
                             lambda F_, i, w, p: F_.embedding(i, w, padding_idx=p)),
    "embedding_scaled": lambda dt: ((torch.randint(0, 40, (5, 9), device="cuda"), _leaf((40, 64), dt, 0)),
                                    lambda F_, i, w: F_.embedding(i, w, scale_grad_by_freq=True)),
}
ATTN_DTYPES = (torch.float16, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(FN_CASES))
def test_functions_match_pytorch_forward_and_backward(case, dtype):
    inputs, call = FN_CASES[case](dtype)
    out, grads = _grads(lambda *a: call(ct, *a), *inputs)
    ref, ref_grads = _grads(lambda *a: call(_functional.ORIGINAL_F, *a), *inputs)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if case == "group_norm_channels_last":
        assert out.stride() == inputs[0].stride()   # the layout is kept
    _close(out, ref, dtype)
    for g, r in zip(grads, ref_grads):
        _close(g, r, dtype if dtype != torch.bfloat16 else torch.bfloat16)
    name = case.split("_2d")[0].replace("_channels_last", "").replace("_scaled", "")
    assert ct.counts()[name]["cukern"] == 1 and ct.counts()[name]["torch"] == 0


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("causal, hkv, d", [(False, 8, 64), (True, 8, 128), (True, 2, 64), (False, 1, 96)])
def test_sdpa_matches_pytorch_forward_and_backward(dtype, causal, hkv, d):
    q = _leaf((2, 8, 300, d), dtype, 0)
    k, v = _leaf((2, hkv, 300, d), dtype, 1), _leaf((2, hkv, 300, d), dtype, 2)
    gqa = hkv != 8
    out, grads = _grads(lambda q, k, v: ct.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
                        q, k, v)
    kw = {"enable_gqa": True} if gqa else {}
    ref, ref_grads = _grads(lambda q, k, v: ORIG["scaled_dot_product_attention"](q, k, v, is_causal=causal, **kw),
                            q, k, v)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _close(out, ref, dtype)
    for g, r in zip(grads, ref_grads):
        _close(g, r, dtype)
    assert ct.counts()["scaled_dot_product_attention"] == {"cukern": 1, "torch": 0}


@gpu
@needs_cuda
@pytest.mark.parametrize("case", [*FN_CASES, "sdpa"])
def test_eager_path_and_custom_ops_give_the_same_bits(case):
    """Outside torch.compile a drop-in launches through the op's autograd.Function; inside,
    through the custom op. Both must compute the same thing, forward and backward, on the
    arguments the drop-in's route gives them."""
    from cukern.torch._functional import DROPIN_SPECS
    from cukern.torch._ops import OPS

    if case == "sdpa":
        inputs = [_leaf((2, 4, 130, 64), torch.bfloat16, s) for s in range(3)]
        name, f_args, kw = "scaled_dot_product_attention", inputs, {"is_causal": True}
    else:
        inputs, _ = FN_CASES[case](torch.bfloat16)
        name, f_args, kw = case.split("_2d")[0].replace("_channels_last", "").replace("_scaled", ""), inputs, {}
        if case == "embedding_scaled":
            kw = {"scale_grad_by_freq": True}
    op, args, post = DROPIN_SPECS[name].route(_tools, *f_args, **kw)
    post = post or (lambda t: t)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    runs = []
    torch.use_deterministic_algorithms(True)   # (attention's dq: no atomics, so bits repeat)
    try:
        for call in (OPS[op], OPS[op].compiled):
            out = post(call(*args))
            dy = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda",
                             dtype=out.dtype)
            runs.append((out, torch.autograd.grad(out, leaves, dy)))
    finally:
        torch.use_deterministic_algorithms(False)
    (out_e, grads_e), (out_o, grads_o) = runs
    assert torch.equal(out_e, out_o) and out_e.stride() == out_o.stride()
    assert len(grads_e) == len(grads_o) and all(torch.equal(a, b) for a, b in zip(grads_e, grads_o))


@gpu
@needs_cuda
def test_unsupported_gpu_calls_fall_back_with_a_reason():
    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    kq = torch.randn(1, 2, 24, 64, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(16, 16, device="cuda", dtype=torch.bool).tril()
    calls = [
        (lambda f: f(q, q, q, attn_mask=mask), "attn_mask"),
        (lambda f: f(q.float(), q.float(), q.float()), "dtype torch.float32"),
        (lambda f: f(q, kq, kq, is_causal=True), "causal with seqlen_q != seqlen_k"),
        (lambda f: f(q[..., :48], q[..., :48], q[..., :48]), "batch or head_dim"),
    ]
    for call, _ in calls:
        torch.testing.assert_close(call(ct.scaled_dot_product_attention),
                                   call(ORIG["scaled_dot_product_attention"]), rtol=0, atol=0)
    w = torch.randn(10, 8, device="cuda")
    idx = torch.randint(0, 10, (4,), device="cuda")
    torch.testing.assert_close(ct.embedding(idx, w.clone(), max_norm=1.0),
                               ORIG["embedding"](idx, w.clone(), max_norm=1.0))
    x = torch.randn(3, 8, device="cuda", dtype=torch.float64)
    torch.testing.assert_close(ct.layer_norm(x, (8,)), ORIG["layer_norm"](x, (8,)))
    c = ct.counts(reasons=True)
    assert c["scaled_dot_product_attention"]["cukern"] == 0
    assert set(c["scaled_dot_product_attention"]["torch_reasons"]) == {r for _, r in calls}
    assert c["embedding"]["torch_reasons"] == {"max_norm or sparse": 1}
    assert c["layer_norm"]["torch_reasons"] == {"dtype torch.float64": 1}


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast_casts_as_pytorch_does(dtype):
    x = _leaf((4, 64, 128), dtype, 0)
    w, wg = _leaf((128,), torch.float32, 1), _leaf((64,), torch.float32, 3)
    qkv = _leaf((2, 4, 128, 64), dtype, 2)
    ct.patch()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = [F.layer_norm(x, (128,), w, w), F.rms_norm(x, (128,), w), F.group_norm(x, 4, wg, wg),
               F.scaled_dot_product_attention(qkv, qkv, qkv, is_causal=True)]
    ct.unpatch()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expect = [ORIG["layer_norm"](x, (128,), w, w), ORIG["rms_norm"](x, (128,), w), ORIG["group_norm"](x, 4, wg, wg),
                  ORIG["scaled_dot_product_attention"](qkv, qkv, qkv, is_causal=True)]
    for a, e in zip(got, expect):
        assert a.dtype == e.dtype
        _close(a, e, torch.bfloat16 if torch.bfloat16 in (a.dtype, dtype) else a.dtype)
    assert all(ct.counts()[n]["cukern"] == 1 for n in ("layer_norm", "rms_norm", "group_norm",
                                                         "scaled_dot_product_attention"))


@gpu
@needs_cuda
def test_gradient_accumulation_matches_pytorch():
    cfg = demo.Config(layers=2, dim=128, heads=2, vocab=500, seq=64)
    grads = []
    for patched in (False, True):
        torch.manual_seed(0)
        model = demo.GPT(cfg).cuda()
        gen = torch.Generator(device="cuda").manual_seed(3)
        with ct.patch() if patched else _nothing():
            for _ in range(3):   # three micro-batches into the same .grad
                tokens, targets = demo.batch(gen, 4, cfg.seq, cfg.vocab, "cuda")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    model(tokens, targets).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        a, b = grads[0][n], grads[1][n]
        assert (a - b).norm() <= 0.03 * a.norm() + 1e-6, n


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- GPU: opcheck and torch.compile ---------------------------------------------------------

def _opcheck_cases():
    from torch_helpers import family_tables

    return [c for table in family_tables("opcheck_samples") for c in table]


@gpu
@needs_cuda
def test_opcheck():
    """torch.library.opcheck of every sample the families declare (schema, fake, autograd)."""
    cases = _opcheck_cases()
    assert cases
    for op, args in cases:
        torch.library.opcheck(op, args)


@gpu
@needs_cuda
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_compiled_model_has_no_graph_breaks_and_matches_eager(norm):
    cfg = demo.Config(layers=2, dim=128, heads=2, vocab=500, seq=64, norm=norm)
    torch.manual_seed(0)
    model = demo.GPT(cfg).cuda()
    tokens, targets = demo.batch(torch.Generator(device="cuda").manual_seed(0), 4, cfg.seq, cfg.vocab, "cuda")
    torch._dynamo.reset()
    with ct.patch():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eager = model(tokens, targets)
            compiled = torch.compile(model, fullgraph=True)(tokens, targets)   # fullgraph: a break raises
        compiled.backward()
        explain = torch._dynamo.explain(model)(tokens, targets)
    assert explain.graph_break_count == 0
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    assert all(p.grad is not None for p in model.parameters())


# ---- GPU: the training demo and DistributedDataParallel -------------------------------------

@gpu
@needs_cuda
def test_short_training_run_patched_and_unpatched_agree():
    cfg = demo.Config(layers=2, dim=256, heads=4, vocab=1000, seq=256)
    runs = [demo.train(cfg, steps=40, batch_size=8, patched=p, accum=2, timed_from=5) for p in (False, True)]
    a, b = runs[0]["losses"], runs[1]["losses"]
    assert a[-1] < a[0] - 0.3   # it learns (at least the skewed token frequencies)
    assert max(abs(x - y) for x, y in zip(a, b)) < 0.05, (a, b)
    c = runs[1]["counts"]
    assert all(c[n]["cukern"] > 0 and c[n]["torch"] == 0 for n in ("layer_norm", "embedding",
                                                                     "scaled_dot_product_attention"))


@gpu
@needs_cuda
def test_deterministic_training_runs_repeat_bit_for_bit(monkeypatch):
    """Under demo.deterministic() a run repeats exactly, patched or not (train-demo --deterministic):
    PyTorch's SDPA backward and cukern's attention backward both take their deterministic paths."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    cfg = demo.Config(layers=2, dim=256, heads=4, vocab=1000, seq=256)
    try:
        demo.deterministic()
        for patched in (False, True):
            runs = []
            for _ in range(2):
                for name in _tools.MIN_SIZE:   # (each run's unpatch restores the thresholds)
                    _tools.MIN_SIZE[name] = 0
                runs.append(demo.train(cfg, steps=6, batch_size=4, patched=patched, timed_from=2))
            a, b = (r["losses"] for r in runs)
            assert a == b, (patched, a, b)
            if patched:   # (both runs on cukern's kernels, not PyTorch's)
                for r in runs:
                    assert all(r["counts"][n]["cukern"] > 0 and r["counts"][n]["torch"] == 0
                               for n in ("layer_norm", "embedding", "scaled_dot_product_attention")), r["counts"]
    finally:
        torch.use_deterministic_algorithms(before)


@gpu
@needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_on_two_gpus_patched_and_unpatched_agree(tmp_path):
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "cukern",
           "train-demo", "--layers", "2", "--dim", "256", "--heads", "4", "--vocab", "1000", "--seq", "1024",
           "--batch", "4", "--steps", "30", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json
    runs = json.loads(out.read_text())["runs"]
    a, b = runs["PyTorch"]["losses"], runs["cukern.patch()"]["losses"]
    assert max(abs(x - y) for x, y in zip(a, b)) < 0.05
    assert runs["cukern.patch()"]["counts"]["scaled_dot_product_attention"]["cukern"] > 0
    assert runs["cukern.patch()"]["kernel_devices"] == [0, 1]   # rank r's kernels on GPU r only


# ---- GPU: no hidden work, CUDA graphs, the plan cache -----------------------------------------

def _kernels_of(fn):
    """Names of the CUDA kernels, copies and fills ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()   # compile, plan and allocate outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _kernel_kinds(names):
    """The kernel names without template arguments."""
    return sorted(n.split("<")[0].replace("void ", "").strip() for n in names)


@gpu
@needs_cuda
def test_a_call_launches_its_kernels_and_nothing_else():
    """No hidden GPU work: every family's drop-in calls (``torch_kernel_cases()`` of its test
    module) launch their kernels and no layout copies, fills or casts (the SDPA drop-in reads
    (B, H, S, D) in place and returns its layout)."""
    from torch_helpers import family_tables

    cases = {k: v for table in family_tables("torch_kernel_cases") for k, v in table.items()}
    assert cases
    for case, (fn, expect) in cases.items():
        got = _kernel_kinds(_kernels_of(fn))
        assert got == sorted(expect), f"{case}: launched {got}"


@gpu
@needs_cuda
def test_embedding_backward_launches_only_its_own_steps():
    """The embedding backward: its kernels (the keys' sort among them) and the zeroing of its
    counts (the per-row 'touched' flags and the sort's digit counts), nothing else."""
    idx = torch.randint(0, 1000, (4, 64), device="cuda")
    w = torch.randn(1000, 64, device="cuda", requires_grad=True)
    dy = torch.randn(4, 64, 64, device="cuda")
    names = _kernels_of(lambda: torch.autograd.grad(ct.embedding(idx, w), (w,), dy))
    ours = [n for n in _kernel_kinds(names) if n.startswith("embedding")]
    # (indices below 1024: two passes of 9-bit digits)
    assert ours == ["embedding_bwd_chunks", "embedding_bwd_combine", "embedding_bwd_keys",
                    *["embedding_bwd_sort_pass"] * 2, "embedding_fwd_warp"]
    others = sorted(n for n in names if not n.split("<")[0].replace("void ", "").startswith("embedding"))
    counts = _kernels_of(lambda: torch.empty(1000, dtype=torch.int32, device="cuda").fill_(0))
    assert others == sorted(counts), others


@gpu
@needs_cuda
def test_custom_ops_run_under_cuda_graphs_and_replays_repeat_the_results():
    """torch.compile(mode="reduce-overhead") captures the custom ops in a CUDA graph; every
    replay gives the eager results (every op, forward and backward)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    x, w, b = t(64, 256).requires_grad_(True), t(256).requires_grad_(True), t(256).requires_grad_(True)
    xg, wg = t(4, 32, 8, 8).requires_grad_(True), t(32).requires_grad_(True)
    q = t(2, 128, 4, 64).requires_grad_(True)
    idx = torch.randint(0, 100, (4, 64), device="cuda")
    table = t(100, 256).requires_grad_(True)
    ops = torch.ops.cukern

    def step(x, w, b, xg, wg, q, table):
        y = ops.layer_norm(x, w, b, 1e-5, 0.0)[0] + ops.rms_norm(x, w, 1e-6, 0.0, 0)[0]
        z = ops.group_norm(xg, 4, wg, None, 1e-5)[0]
        o = ops.attention(q, q, q, True, 0.125, -1, -1, 0.0, -1)[0]
        e = ops.embedding(idx, table, None, False)
        return y.float().square().mean() + z.float().square().mean() + o.float().square().mean() + e.float().mean()

    leaves = (x, w, b, xg, wg, q, table)
    torch.use_deterministic_algorithms(True)   # (attention's dq: no atomics, so the bits repeat)
    try:
        loss = step(*leaves)
        expect = [loss.detach()] + list(torch.autograd.grad(loss, leaves))
        compiled = torch.compile(step, mode="reduce-overhead")
        for _ in range(4):   # warm-up, recording, then replays
            loss = compiled(*leaves)
            got = [loss.detach().clone()] + [gr.clone() for gr in torch.autograd.grad(loss, leaves)]
            for a, e in zip(got, expect):
                torch.testing.assert_close(a, e, rtol=1e-2, atol=1e-3)
    finally:
        torch.use_deterministic_algorithms(False)


@gpu
@needs_cuda
def test_a_repeated_call_reuses_its_launch_plan():
    import importlib

    norm = importlib.import_module("cukern.norm")
    x = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    y1 = ct.rms_norm(x, (128,), w)
    first = dict(norm._FWD.plans)
    y2 = ct.rms_norm(x.clone(), (128,), w.clone())   # other buffers, the same call signature
    assert norm._FWD.plans.keys() == first.keys() and all(norm._FWD.plans[k] is p for k, p in first.items())
    assert torch.equal(y1, y2)


@gpu
@needs_cuda
def test_small_calls_stay_with_pytorch_with_the_reason_counted():
    """Below a function's min_size PyTorch's own function runs (its dispatch costs less host
    time than cukern's kernels can save); patch(min_size=0) routes those calls too."""
    from cukern.torch._functional import DEFAULT_MIN_SIZE

    for name in _tools.MIN_SIZE:
        _tools.MIN_SIZE[name] = DEFAULT_MIN_SIZE[name]
    small = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(ct.layer_norm(small, (128,), w), ORIG["layer_norm"](small, (128,), w), rtol=0, atol=0)
    ct.layer_norm(big, (1024,))
    c = ct.counts(reasons=True)["layer_norm"]
    assert c["cukern"] == 1 and c["torch"] == 1 and c["torch_reasons"] == {_tools.SMALL: 1}
    ct.reset_counts()
    with ct.patch(min_size=0):
        F.layer_norm(small, (128,), w)
    assert ct.counts()["layer_norm"] == {"cukern": 1, "torch": 0}


def test_a_patched_model_traces_under_compile_on_the_cpu():
    """torch.compile of a patched model: the functions left to PyTorch inside graphs reach the
    drop-in again through __torch_function__ on fake tensors while AOTAutograd traces; that
    call must run PyTorch's function (aot_eager: the tracing, without code generation)."""
    cfg = demo.Config(layers=1, dim=32, heads=2, vocab=50, seq=16)
    torch.manual_seed(0)
    model = demo.GPT(cfg)
    tokens, targets = demo.batch(torch.Generator().manual_seed(0), 2, cfg.seq, cfg.vocab, "cpu")
    torch._dynamo.reset()
    with ct.patch():
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(tokens, targets)
        eager = model(tokens, targets)
    torch.testing.assert_close(compiled, eager)
    compiled.backward()


@gpu
@needs_cuda
def test_kernels_launch_from_a_thread_that_has_made_no_cuda_call():
    """The autograd engine runs backward on its own thread; when every tensor there comes from
    torch's cache that thread has made no CUDA runtime call and has no context current, and a
    driver launch fails (CUDA_ERROR_INVALID_CONTEXT) unless cukern binds the device first."""
    from torch_helpers import in_fresh_thread

    import cukern

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    expect = cukern.rms_norm(x, w)   # (compiled, so the thread launches at once)
    spare = torch.empty_like(expect)
    del spare                        # torch's cache holds a block for the thread's output
    torch.cuda.synchronize()
    assert torch.equal(in_fresh_thread(lambda: cukern.rms_norm(x, w)), expect)


@pytest.mark.parametrize("opts", [{}, {"z_loss": 1e-3, "softcap": 4.0, "ignore_index": 2}, {"reduction": "sum"}])
def test_linear_cross_entropy_on_the_cpu_is_pytorchs_and_has_gradients(opts):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 4, 16, generator=g, requires_grad=True)
    w = torch.randn(30, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 30, (3, 4), generator=g)
    loss = ct.LinearCrossEntropyLoss(**opts)(h, w, t)
    z = F.linear(h, w).reshape(-1, 30)
    if opts.get("softcap"):
        z = opts["softcap"] * torch.tanh(z / opts["softcap"])
    ignore = opts.get("ignore_index", -100)
    expect = F.cross_entropy(z, t.reshape(-1), ignore_index=ignore, reduction=opts.get("reduction", "mean"))
    if opts.get("z_loss"):
        keep = (t.reshape(-1) != ignore).float()
        expect = expect + (opts["z_loss"] * torch.logsumexp(z, -1) ** 2 * keep).sum() / keep.sum()
    torch.testing.assert_close(loss, expect)
    assert all(a is not None for a in torch.autograd.grad(loss, (h, w)))
    assert "linear_cross_entropy" in ct.__all__ and "LinearCrossEntropyLoss" in ct.__all__


@gpu
@needs_cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_linear_cross_entropy_matches_pytorch_forward_and_backward(autocast):
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.float32 if autocast else torch.bfloat16
    h = (torch.randn(4, 100, 64, device="cuda", generator=g)).to(dt).requires_grad_(True)
    w = (torch.randn(5000, 64, device="cuda", generator=g) * 0.2).to(dt).requires_grad_(True)
    b = torch.randn(5000, device="cuda", generator=g).to(dt).requires_grad_(True)
    t = torch.randint(0, 5000, (4, 100), device="cuda", generator=g)
    t[:, ::7] = -100
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = ct.linear_cross_entropy(h, w, t, b, label_smoothing=0.1)
        expect = F.cross_entropy(F.linear(h, w, b).reshape(-1, 5000), t.reshape(-1), label_smoothing=0.1)
    assert loss.dtype == expect.dtype
    up = torch.tensor(0.7, device="cuda", dtype=loss.dtype)
    got, ref = torch.autograd.grad(loss, (h, w, b), up), torch.autograd.grad(expect, (h, w, b), up)
    torch.testing.assert_close(loss.float(), expect.float(), rtol=2e-2, atol=2e-2)
    for a, e, name in zip(got, ref, ("dhidden", "dweight", "dbias")):
        assert (a.float() - e.float()).norm() <= 3e-2 * e.float().norm(), name


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_the_losses_custom_ops_and_their_autograd_run_on_meta_tensors(op):
    """What torch.compile traces of the loss ops — the custom op's fake, its autograd formula
    and the backward op's fake — on meta tensors (no GPU needed): shapes and dtypes, the
    float32 loss of autocast, and gradients for the inputs that need them."""
    from cukern.torch._ops import OPS as BUILT

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, device="meta", dtype=dtype).requires_grad_(dtype.is_floating_point)

    target = t(6, dtype=torch.long)
    if op == "cross_entropy":
        x = t(6, 30)
        loss = BUILT[op].compiled(x, target, -100, 0.1, 0.0, 0.0, "mean", True)
        (gx,) = torch.autograd.grad(loss, (x,), torch.ones((), device="meta"))
        assert loss.shape == () and loss.dtype == torch.float32
        assert gx.shape == x.shape and gx.dtype == x.dtype
    else:
        h, w, b = t(2, 3, 16), t(30, 16), t(30)
        loss = BUILT[op].compiled(h, w, target.reshape(2, 3), b, -100, 0.0, 0.0, 0.0, "sum", False)
        grads = torch.autograd.grad(loss, (h, w, b), torch.ones((), device="meta", dtype=loss.dtype))
        assert loss.shape == () and loss.dtype == torch.bfloat16
        assert [g.shape for g in grads] == [h.shape, w.shape, b.shape]
        loss = BUILT[op].compiled(h, w, target.reshape(2, 3), None, -100, 0.0, 0.0, 0.0, "mean", False)
        gh, gw = torch.autograd.grad(loss, (h, w), torch.ones((), device="meta", dtype=loss.dtype))
        assert gh.shape == h.shape and gw.shape == w.shape
