"""Launch plans and argument handling shared by every family, with no GPU: NumPy arrays stand
in for device arrays and each call stops where its plan would run (conftest's DryRun), so the
checks, the plan cache and the kernel arguments (packed against the declared signatures) are
tested on the CPU. The same bad arguments get the same messages from the kernels' fronts and
from the NumPy references."""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
from conftest import DryRun

import cukern
from cukern import _arrays
from cukern import reference as ref

norm = importlib.import_module("cukern.norm")


def _plan(call):
    with pytest.raises(DryRun) as info:
        call()
    return info.value.plan


def _launch_args(plan, kernel: str) -> dict:
    """The packed arguments (by parameter name) of the plan's launch of ``kernel``."""
    found = [s for s in plan.steps if isinstance(s, tuple) and s[1].kernel_name == kernel]
    assert found, f"no launch of {kernel} in {plan.steps}"
    return found[0][4]


def test_a_repeated_call_signature_reuses_its_plan(host_arrays_as_device):
    x = np.ones((8, 64), np.float16)
    w = np.ones(64, np.float16)
    first = _plan(lambda: cukern.layer_norm(x, w))
    assert _plan(lambda: cukern.layer_norm(x.copy(), w.copy())) is first   # other buffers, same signature
    assert _plan(lambda: cukern.layer_norm(x[:, :32], w[:32])) is not first   # another shape
    assert _plan(lambda: cukern.layer_norm(x, w, eps=1e-3)) is not first   # another scalar
    assert _plan(lambda: cukern.layer_norm(x, w, return_stats=True)) is not first
    assert _plan(lambda: cukern.layer_norm(x.astype(np.float32), w.astype(np.float32))) is not first


def test_plans_read_strided_rows_in_place_and_copy_only_what_they_must(host_arrays_as_device):
    wide = np.ones((8, 96), np.float16)
    plan = _plan(lambda: cukern.layer_norm(wide[:, :64]))              # rows of a wider buffer
    assert plan.fixes == ()
    assert _launch_args(plan, "norm_fwd")["x_stride"] == 96
    plan = _plan(lambda: cukern.layer_norm(np.ones((64, 8), np.float16).T))   # columns: copied
    assert [slot for slot, _ in plan.fixes] == [0]
    assert _launch_args(plan, "norm_fwd")["x_stride"] == 64


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_attention_reads_sdpa_layout_and_packed_qkv_without_copies(host_arrays_as_device, monkeypatch, cc):
    """No copies of SDPA's layout or of packed qkv: the sm_80 kernel takes their strides, the
    Hopper one (sm_90) tensor maps of the buffers as they are."""
    from cukern import _kernels

    monkeypatch.setattr(_kernels, "compute_capability", lambda device: cc)
    attn = importlib.import_module("cukern.attention")
    attn._FWD.clear()   # (plans assume one device)
    b, h, s, d = 2, 4, 16, 64
    if cc == (9, 0):
        # (the Hopper path on, as shipped, even where CUKERN_ATTENTION_SM80=1 turned it off)
        monkeypatch.setattr(attn.configs, "CONFIGS", dataclasses.replace(attn.configs.CONFIGS, use_sm90=True))
        sdpa = np.ones((b, h, s, d), np.float16).transpose(0, 2, 1, 3)
        qkv = np.ones((b, s, 3, h, d), np.float16)
        for q, k, v in ((sdpa, sdpa, sdpa), (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])):
            plan = _plan(lambda: cukern.attention(q, k, v))
            assert plan.fixes == ()
            args = _launch_args(plan, "attention_fwd_sm90")
            assert all(isinstance(args[m], bytes) for m in ("q_map", "k_map", "v_map"))
        return
    sdpa = np.ones((b, h, s, d), np.float16).transpose(0, 2, 1, 3)     # (B, S, H, D) view of (B, H, S, D)
    plan = _plan(lambda: cukern.attention(sdpa, sdpa, sdpa))
    assert plan.fixes == ()
    args = _launch_args(plan, "attention_fwd")
    assert (args["q_sb"], args["q_ss"], args["q_sh"]) == (h * s * d, d, s * d)
    assert (args["o_sb"], args["o_ss"], args["o_sh"]) == (h * s * d, d, s * d)   # out in q's layout
    qkv = np.ones((b, s, 3, h, d), np.float16)
    plan = _plan(lambda: cukern.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]))
    assert plan.fixes == ()
    args = _launch_args(plan, "attention_fwd")
    assert (args["k_sb"], args["k_ss"], args["k_sh"]) == (s * 3 * h * d, 3 * h * d, d)
    assert (args["o_sb"], args["o_ss"], args["o_sh"]) == (s * h * d, h * d, d)   # not dense: contiguous


@pytest.mark.parametrize("obj, what", [(3.0, "a float scalar"), (3, "an int scalar"), ("abc", "a string"),
                                       (True, "a bool"), (np.float32(1), "a float32 scalar"),
                                       ([1.0, 2.0], "a builtins.list")])
def test_scalars_and_strings_are_rejected_as_what_they_are(obj, what):
    what = what.replace("an int", "a int")
    with pytest.raises(TypeError, match=rf"^x: expected a CuPy array or a torch CUDA tensor, got {what}"):
        cukern.rms_norm(obj, 1.0)
    if not isinstance(obj, list):   # (a list is an array to NumPy and to the references)
        with pytest.raises(TypeError, match=rf"^x: expected an array, got {what}"):
            ref.rms_norm(obj)


F16 = np.float16
X = np.ones((4, 8), F16)
BAD_CALLS = {
    "layer_norm": [((X, np.ones(7, F16)), {}), ((X, np.ones(8, np.float32)), {}), ((X,), {"eps": -1.0}),
                   ((X,), {"eps": "x"}), ((X,), {"residual": np.ones((4, 7), F16)}), ((np.ones(3, np.int32),), {}),
                   ((np.array(2, F16),), {})],
    "rms_norm": [((X, np.ones(7, F16)), {}), ((X,), {"eps": float("nan")})],
    "layer_norm_backward": [((X, X, None, np.ones(4, np.float32), np.ones(5, np.float32)), {}),
                            ((X, X[:2], None, np.ones(4, np.float32), np.ones(4, np.float32)), {})],
    "group_norm": [((np.ones((2, 6, 3), F16), 4), {}), ((np.ones((2, 6, 3), F16), 0), {}),
                   ((np.ones((2, 6, 3), F16), 2.0), {}), ((np.ones(6, F16), 2), {}),
                   ((np.ones((2, 6, 3), F16), 2, np.ones(5, F16)), {})],
    "embedding": [((np.array([0, 1]), np.ones(4, F16)), {}), ((np.array([0.0]), np.ones((4, 2), F16)), {}),
                  ((np.array([0]), np.ones((4, 2), F16)), {"padding_idx": 4}),
                  ((np.array([0]), np.ones((4, 2), F16)), {"padding_idx": 1.5})],
    "embedding_backward": [((np.ones((2, 3), F16), np.array([0, 1]), 0), {}),
                           ((np.ones((2, 3), F16), np.array([0, 1]), 2.5), {}),
                           ((np.ones((3, 3), F16), np.array([0, 1]), 4), {})],
    "attention": [((np.ones((1, 4, 2, 64), np.float32),) * 3, {}), ((np.ones((1, 4, 2, 64), F16),) * 3,
                                                                     {"softmax_scale": 0.0}),
                  ((np.ones((1, 4, 2, 64), F16), np.ones((1, 4, 3, 64), F16), np.ones((1, 4, 3, 64), F16)), {}),
                  ((np.ones((4, 2, 64), F16),) * 3, {})],
}


@pytest.mark.parametrize("op", list(BAD_CALLS))
def test_references_check_arguments_as_the_kernels_do(op, host_arrays_as_device):
    """Every bad call raises the same exception with the same message from the kernel's front
    (its checks run on the CPU here) and from the NumPy reference."""
    for args, kw in BAD_CALLS[op]:
        errors = []
        for fn in (getattr(cukern, op), getattr(ref, op)):
            try:
                fn(*args, **kw)
            except DryRun:
                errors.append(None)
            except (TypeError, ValueError, IndexError) as e:
                errors.append((type(e), str(e)))
        assert errors[0] is not None, f"{op}{args, kw}: the kernel's front accepted it"
        assert errors[0] == errors[1], f"{op}: front {errors[0]} vs reference {errors[1]}"


def test_the_reference_namespace_holds_the_references_only():
    public = {n for n in dir(ref) if not n.startswith("_")}
    assert public == set(ref.__all__)
    assert {"layer_norm", "rms_norm_backward", "group_norm", "embedding", "attention_backward"} <= public
    assert "np" not in public and "annotations" not in public


def test_like_strides_keep_a_dense_layout_and_order_the_rest():
    assert _arrays.like_strides((2, 3, 4, 5), (60, 5, 15, 1)) == (60, 5, 15, 1)
    assert _arrays.like_strides((2, 16, 4, 64), (16 * 3 * 4 * 64, 3 * 4 * 64, 64, 1)) == (16 * 4 * 64, 4 * 64, 64, 1)
    assert _arrays.like_strides((3, 4), (4, 1)) == (4, 1)
    # a broadcast axis (K and V expanded over the heads) goes outermost: the unit-stride axis
    # stays innermost (ordered by its 0 stride, it went innermost, and outputs laid out like
    # it took the kernels' unit-stride stores at odd addresses)
    assert _arrays.like_strides((2, 131, 2, 64), (131 * 64, 64, 0, 1)) == (131 * 64, 64, 2 * 131 * 64, 1)
    assert _arrays.like_strides((2, 5, 3), (0, 3, 1)) == (15, 3, 1)
    assert _arrays.like_strides((1, 5, 3), (0, 3, 1))[1:] == (3, 1)   # (one element: not broadcast)


def test_a_fill_step_fills_the_given_buffers_and_skips_absent_ones():
    from cukern._plans import Builder

    arrays = [_arrays.wrap(np.ones(3, np.float32), "x"), None]
    b = Builder(arrays)
    out = b.alloc((2,), "float32")
    b.fill(7.0, out, None, b.slot(1))
    bufs = arrays + [_arrays.wrap(np.zeros(2, np.float32), "out")]
    for step in b.steps:
        step(bufs, [0, 0, 0], 0)
    assert bufs[2].obj.tolist() == [7.0, 7.0] and bufs[0].obj.tolist() == [1.0, 1.0, 1.0]


def test_plan_cache_builds_once_a_key_and_never_keeps_an_unkeyed_call():
    from cukern._plans import PlanCache

    built = []

    def build(*args):
        built.append(args)
        return object()

    cache = PlanCache(limit=2)
    a = cache.plan(("a",), build, 1, 2)
    assert cache.plan(("a",), build, 3) is a and built == [(1, 2)]          # kept: built once
    assert cache.plan(None, build, 4) is not cache.plan(None, build, 5)    # no key: built every call
    assert built[1:] == [(4,), (5,)] and len(cache.plans) == 1
    cache.plan(("b",), build)
    cache.plan(("c",), build)                                              # bounded: the oldest goes
    assert list(cache.plans) == [("b",), ("c",)]
