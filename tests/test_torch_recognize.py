"""``patch(model)`` finds the norms by running them (cukern/torch/_recognize.py): for each named
family, a tiny model from its config, on the CPU, in bfloat16 (where the roundings differ) and
float32; the variant found for every norm module; modules that only look like norms left alone
with the reason; a norm no library knows by name routed all the same."""
from __future__ import annotations

import functools
import importlib.util
import types

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)

import transformers  # noqa: E402
from torch import nn  # noqa: E402

import cukern.torch as ct  # noqa: E402
from cukern.torch import _models, _recognize, _recognize_experts  # noqa: E402

LLAMA_RMS = "norm: RMSNorm, casting llama"
GEMMA_RMS = "norm: RMSNorm, weight + 1, casting gemma"
FLOAT32_RMS = "norm: RMSNorm, casting gemma"

# family: (config class, model class, config overrides, {module-name suffix: decision})
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {"input_layernorm": LLAMA_RMS, "model.norm": LLAMA_RMS}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, {"post_attention_layernorm": LLAMA_RMS}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, {"input_layernorm": LLAMA_RMS}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16},
              {"self_attn.q_norm": LLAMA_RMS, "self_attn.k_norm": LLAMA_RMS, "input_layernorm": LLAMA_RMS}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16},
               {"pre_feedforward_layernorm": GEMMA_RMS, "post_feedforward_layernorm": GEMMA_RMS,
                "model.norm": GEMMA_RMS}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16},
               {"self_attn.q_norm": GEMMA_RMS, "post_attention_layernorm": GEMMA_RMS, "model.norm": GEMMA_RMS}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, {"input_layernorm": LLAMA_RMS}),
    # (OLMo 2 multiplies the weight in float32 and rounds once; its QK-norm spans the full width)
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0, "eos_token_id": 1},
              {"self_attn.q_norm": FLOAT32_RMS, "post_feedforward_layernorm": FLOAT32_RMS}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"pad_token_id": 0}, {"input_layernorm": LLAMA_RMS}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"pad_token_id": 0},
                 {"input_layernorm": "norm: nn.LayerNorm", "final_layer_norm": "norm: nn.LayerNorm"}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}, {"input_layernorm": "norm: nn.LayerNorm"}),
}


SWIGLU = "mlp: SwiGLU, gate_proj / up_proj / down_proj"
GEGLU_TANH = "mlp: GeGLU (tanh), gate_proj / up_proj / down_proj"
MLPS = {"llama": SWIGLU, "mistral": SWIGLU, "qwen2": SWIGLU, "qwen3": SWIGLU, "olmo2": SWIGLU, "granite": SWIGLU,
        "gemma2": GEGLU_TANH, "gemma3": GEGLU_TANH,
        "phi3": "mlp: SwiGLU, gate_up_proj fused (gate half first), down_proj",
        "gpt_neox": None, "starcoder2": None}   # (not gated: their activations are the drop-ins')


@functools.lru_cache(maxsize=None)   # (one model a family and dtype: patch(model) leaves it as it was)
def _tiny(family: str, dtype):
    cfg_cls, model_cls, over, _ = FAMILIES[family]
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    base.update(over)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**base)).to(dtype)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_norm_of_the_named_families_is_found_by_what_it_computes(family):
    expect = FAMILIES[family][3]
    model = _tiny(family, torch.bfloat16)
    with ct.patch(model):
        got = ct.routing(model)
        for suffix, decision in expect.items():
            names = [n for n in got if n.endswith(suffix)]
            assert names, f"{family}: no module named *{suffix} was looked at: {sorted(got)}"
            assert all(got[n] == decision for n in names), {n: got[n] for n in names}
        norms = [n for n, m in model.named_modules() if _models._norm_shaped(m)]
        assert norms and all(got[n].startswith("norm: ") for n in norms), {n: got.get(n) for n in norms}
        assert all(type(m).forward is not m.forward for n, m in model.named_modules() if n in norms)
    assert ct.routing(model) == {}
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("family", ["llama", "gemma3", "olmo2"])
def test_in_float32_the_roundings_coincide_and_the_norms_are_still_found(family):
    model = _tiny(family, torch.float32)
    with ct.patch(model, parts=["norm"]):
        got = ct.routing(model)
    offset = family.startswith("gemma")
    assert got and all(d.startswith("norm: RMSNorm") and (", weight + 1" in d) == offset for d in got.values())


class UsersRMSNorm(nn.Module):
    """An RMSNorm of a user's own (no library's name): routed all the same."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))   # (not even called weight: looked at through forward)
        self.weight = self.scale
        self.eps = 1e-5

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class Scale(nn.Module):
    """x * w: a 1-D weight, no norm."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x):
        return x * self.weight


class DetachedNorm(UsersRMSNorm):
    """The same forward values, but no gradient reaches x: the backward tells it apart."""

    def forward(self, x):
        return super().forward(x.detach())


class NoEps(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight


def test_modules_that_only_look_like_norms_are_left_alone_with_the_reason():
    model = nn.Sequential(UsersRMSNorm(32), Scale(32), DetachedNorm(32), NoEps(32), nn.LayerNorm(32, bias=False))
    model = model.to(torch.bfloat16)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    expect = model(x)
    with ct.patch(model, parts=["norm"]):
        got = ct.routing(model)
        assert got["0"] == FLOAT32_RMS and "forward" in model[0].__dict__
        assert got["1"].startswith("left alone: computes none of cukern's norms")
        assert got["2"].startswith("left alone: computes none of cukern's norms")
        assert got["3"] == "left alone: no eps attribute"
        assert got["4"] == "norm: nn.LayerNorm"
        assert all("forward" not in model[i].__dict__ for i in (1, 2, 3))
        # (on the CPU the routed modules run their own code again: the same bits)
        assert torch.equal(model(x), expect)
        assert ct.counts()["rms_norm"]["torch"] >= 1


def test_a_verdict_is_reached_once_per_class_and_configuration(monkeypatch):
    calls = []
    probe = _recognize._probe
    monkeypatch.setattr(_recognize, "_cache", {})
    monkeypatch.setattr(_recognize, "_probe", lambda m, eps: calls.append(type(m)) or probe(m, eps))
    model = nn.Sequential(*[UsersRMSNorm(32) for _ in range(5)], UsersRMSNorm(48)).to(torch.bfloat16)
    with ct.patch(model, parts=["norm"]):
        assert len(set(ct.routing(model).values())) == 1
    assert calls == [UsersRMSNorm, UsersRMSNorm]   # (widths 32 and 48)


def test_probing_leaves_the_parameters_and_their_gradients_as_they_were():
    m = UsersRMSNorm(16).to(torch.bfloat16)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
    before = m.weight.detach().clone()
    _recognize._cache.clear()
    variant, why = _recognize.recognize_norm(m)
    assert variant is not None and why is None
    assert torch.equal(m.weight.detach(), before) and m.weight.grad is None


class StrictRMSNorm(UsersRMSNorm):
    """Refuses an input whose dtype is not its weight's."""

    def forward(self, x):
        if x.dtype != self.weight.dtype:
            raise TypeError("dtype")
        return super().forward(x)


def _hf_norm(family: str, d: int):
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = {"llama": "LlamaRMSNorm", "qwen3": "Qwen3RMSNorm", "gemma3": "Gemma3RMSNorm", "olmo2": "Olmo2RMSNorm",
           "t5": "T5LayerNorm", "imagegpt": "ImageGPTLayerNorm"}[family]
    return getattr(mod, cls)(d, eps=1e-6)


MIXED = {"llama": "llama", "qwen3": "llama", "gemma3": "gemma", "olmo2": "gemma", "t5": "float"}


@pytest.mark.parametrize("family", sorted(MIXED))
def test_a_float32_norm_on_16_bit_inputs_is_found_in_the_form_it_computes(family):
    """Under autocast a float32 norm meets bf16 inputs (QK-norms, norms after a sublayer): LLaMA's
    rounds x̂ and promotes to float32, Gemma's and OLMo 2's compute in float32 and round once; each
    is found by running it, and its form's stand-in is the module's own to the rounding."""
    _recognize._cache.clear()
    m = _hf_norm(family, 48)
    v, why = _recognize.recognize_norm(m)
    assert why is None and v.mixed == MIXED[family]
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        m.weight.copy_(torch.rand(48, generator=g) + 0.5)
    for dt in (torch.bfloat16, torch.float16):
        x = (torch.randn(3, 48, generator=g) * 2).to(dt)
        own = m(x)
        want_dtype = dt if MIXED[family] == "gemma" else torch.float32
        got = _recognize.mixed_candidate(v.mixed, v, x, m.weight.detach(), None)
        assert own.dtype == got.dtype == want_dtype
        torch.testing.assert_close(got, own.detach(), rtol=2e-2 if dt == torch.bfloat16 else 2e-3, atol=1e-5)
    # a float32 module that refuses 16-bit inputs keeps its own code for them, and so does one
    # that keeps its statistics in the input's dtype (ImageGPT's: within no form's rounding)
    v, why = _recognize.recognize_norm(StrictRMSNorm(48))
    assert why is None and v.mixed is None
    v, why = _recognize.recognize_norm(_hf_norm("imagegpt", 48))
    assert why is None and v.mixed is None
    # and a bf16 module is never asked
    v, why = _recognize.recognize_norm(_hf_norm(family, 48).to(torch.bfloat16))
    assert why is None and v.mixed is None


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(MIXED))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_norm_on_16_bit_inputs_runs_on_the_kernels_as_its_own(family, dtype):
    """The routed forward of a float32 norm on a 16-bit CUDA input: on the kernels (counted), the
    module's result dtype, its values to the input dtype's rounding, and x's and the float32
    weight's gradients (the weight's in float32) as its own."""
    torch.manual_seed(0)
    m = _hf_norm(family, 1024).cuda()
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
    x = (torch.randn(4, 77, 1024, device="cuda") * 3 + 0.25).to(dtype)
    dy = torch.randn(4, 77, 1024, device="cuda")
    xa = x.clone().requires_grad_(True)
    own = m(xa)
    ga = torch.autograd.grad(own, (xa, m.weight), dy.to(own.dtype))
    ct.reset_counts()
    with ct.patch(m, parts=["norm"], min_size=0):
        assert "forward" in m.__dict__
        xb = x.clone().requires_grad_(True)
        got = m(xb)
        gb = torch.autograd.grad(got, (xb, m.weight), dy.to(got.dtype))
        counts = ct.counts()
    assert counts["rms_norm"] == {"cukern": 1, "torch": 0}
    assert got.dtype == own.dtype and gb[1].dtype == torch.float32
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    scale = own.float().abs().max().item()
    assert (got.float() - own.float()).abs().max().item() <= 2 * ulp * scale
    for a, b in zip(gb, ga):
        assert (a.float() - b.float()).abs().max().item() <= 4 * ulp * b.float().abs().max().item()


@pytest.mark.parametrize("casting", ["gemma", "llama", "none"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_the_candidates_are_the_norm_kernels_arithmetic(casting, offset):
    """The candidates a module is held to compute what cukern's rms_norm does for that variant
    (the PyTorch stand-in the op's tests hold the kernels to)."""
    from test_torch_autograd import TORCH_OWN

    from cukern.norm.configs import CASTING_MODES

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, generator=g).to(torch.bfloat16)
    w = (torch.rand(40, generator=g) + 0.5).to(torch.bfloat16)
    v = _recognize.NormVariant("rms", offset, CASTING_MODES[casting], False, 1e-5)
    expect = TORCH_OWN["rms_norm"](x, w, 1e-5, offset, CASTING_MODES[casting])[0]
    torch.testing.assert_close(_recognize.candidate(v, x, w, None), expect, rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_gated_mlp_of_the_named_families_is_found_by_what_it_computes(family):
    model = _tiny(family, torch.bfloat16)
    x = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        expect = model(x).logits
    with ct.patch(model, parts=["mlp"]):
        got = {n: d for n, d in ct.routing(model).items() if n.endswith(".mlp")}
        if MLPS[family] is None:
            assert got == {}
        else:
            assert got and set(got.values()) == {MLPS[family]}, got
        with torch.no_grad():   # (on the CPU the kernels' calls fall back: the model's own numbers)
            torch.testing.assert_close(model(x).logits, expect, rtol=1e-2, atol=1e-2)


class UpFirstMLP(nn.Module):
    """A fused projection whose up half comes first, GELU by F.gelu in the forward (no
    activation module): found all the same."""

    def __init__(self, h, i):
        super().__init__()
        self.w_in = nn.Linear(h, 2 * i, bias=False)
        self.w_out = nn.Linear(i, h, bias=True)

    def forward(self, x):
        up, gate = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(torch.nn.functional.gelu(gate) * up)


class SumMLP(UpFirstMLP):
    """The shapes of a gated MLP, but a sum instead of the product."""

    def forward(self, x):
        up, gate = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(torch.nn.functional.silu(gate) + up)


def test_an_mlp_no_library_names_is_found_and_a_look_alike_left_alone():
    model = nn.Sequential(UpFirstMLP(32, 48), SumMLP(32, 48)).to(torch.float32)
    x = torch.randn(2, 32)
    expect = model(x)
    with ct.patch(model, parts=["mlp"]):
        got = ct.routing(model)
        assert got["0"] == "mlp: GeGLU, w_in fused (up half first), w_out"
        assert got["1"].startswith("left alone: computes no gated MLP")
        assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__
        torch.testing.assert_close(model(x), expect)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_named_familys_rotary_embedding_is_checked_and_swapped(family):
    model = _tiny(family, torch.bfloat16)
    modname = type(model.model if hasattr(model, "model") else model.gpt_neox).__module__
    mod = importlib.import_module(modname)
    own = mod.apply_rotary_pos_emb
    x = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        expect = model(x).logits
    with ct.patch(model, parts=["rope"]):
        assert ct.routing(model)[f"{modname}.apply_rotary_pos_emb"] == "rope: cukern's rope"
        assert mod.apply_rotary_pos_emb is not own and mod.apply_rotary_pos_emb.cukern_own is own
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, expect, rtol=1e-2, atol=1e-2)
    assert mod.apply_rotary_pos_emb is own


def _rotate_every_two(x):   # GPT-J's interleaved pairs
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def test_a_rotation_cukern_lacks_is_left_alone_and_partial_tables_go_to_the_models_own():
    from cukern.torch import _models

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + _rotate_every_two(q) * sin, k * cos + _rotate_every_two(k) * sin

    import functools

    def backwards(q, k, cos, sin, unsqueeze_dim=1):   # (pairs rotated the other way: sin negated)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos - _rotate_every_two(q) * sin, k * cos - _rotate_every_two(k) * sin

    def mirrored(q, k, cos, sin, unsqueeze_dim=1):   # (dims j and D - 1 - j rotated together: no rope cukern has)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin

    wrap = functools.partial(_models._rope_wrapper, interleaved)
    assert _recognize.recognize_rope("test.interleaved", interleaved, wrap, "cpu", torch.float32) == \
        (None, False, False, False, "paired", False)
    wrap = functools.partial(_models._rope_wrapper, backwards)
    assert _recognize.recognize_rope("test.backwards", backwards, wrap, "cpu", torch.float32) == \
        (None, False, False, False, "paired", True)
    wrap = functools.partial(_models._rope_wrapper, mirrored)
    assert _recognize.recognize_rope("test.mirrored", mirrored, wrap, "cpu", torch.float32) == \
        ("its rotation is not cukern's rope (half-split or interleaved) to the dtype's rounding", False, False, False,
         "", False)

    calls = []

    def partial(q, k, cos, sin, unsqueeze_dim=1):   # (GPT-NeoX's: rotate the first cos.shape[-1] dims)
        calls.append(cos.shape[-1])
        return q, k

    wrapped = _models._rope_wrapper(partial)
    q = torch.randn(1, 2, 3, 16)
    cos = sin = torch.ones(1, 3, 8)
    wrapped(q, q, cos, sin, 1)          # (narrower tables: the model's own function)
    wrapped(q, q, cos, sin, unsqueeze_dim=1)
    assert calls == [8, 8]
    full = torch.ones(1, 3, 16)
    out = wrapped(q, q, full, torch.zeros(1, 3, 16))   # (full width: cukern's; cos 1, sin 0: the identity)
    assert calls == [8, 8] and torch.equal(out[0], q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_is_found_by_running_it_and_computed_as_the_models_own(dtype):
    """GPT-NeoX's and Phi-3's ropes rotate the dims their tables cover and pass the rest on:
    found so (LLaMA's is not: it takes full-width tables alone), and the wrapper's result on
    narrower tables, forward and backward, is the model's own."""
    import functools

    from cukern.torch import _models

    found = {}
    for family in ("gpt_neox", "phi3", "llama"):
        modname = f"transformers.models.{family}.modeling_{family}"
        fn = importlib.import_module(modname).apply_rotary_pos_emb
        why, rounds, partial, _, _, _ = _recognize.recognize_rope(
            modname, fn, functools.partial(_models._rope_wrapper, fn), "cpu", dtype)
        assert why is None
        found[family] = partial
        if not partial:
            continue
        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, 4, 6, 32, generator=g).to(dtype).requires_grad_(True)
        k = torch.randn(2, 2, 6, 32, generator=g).to(dtype).requires_grad_(True)
        angles = torch.rand(2, 6, 4, generator=g) * 6
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)   # (8 of 32 dims)
        got = _models._rope_wrapper(fn, rounds, partial)(q, k, cos, sin)
        want = fn(q, k, cos, sin)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        dys = [torch.randn(t.shape, generator=g).to(t.dtype) for t in want]
        for a, b in zip(torch.autograd.grad(got, (q, k), dys), torch.autograd.grad(want, (q, k), dys)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert found == {"gpt_neox": True, "phi3": True, "llama": False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_width_tables_are_found_by_running_them_and_computed_as_the_models_own(dtype):
    """GPT-OSS's rope takes tables of half the head's width (one angle a pair (j, j + D/2)) and no
    full-width ones: found so, and the wrapper's result (the tables repeated to the kernel's
    width), forward and backward, is the model's own."""
    import functools

    modname = "transformers.models.gpt_oss.modeling_gpt_oss"
    fn = importlib.import_module(modname).apply_rotary_pos_emb
    why, rounds, partial, half, interleave, negate = _recognize.recognize_rope(
        modname, fn, functools.partial(_models._rope_wrapper, fn), "cpu", dtype)
    assert (why, partial, half, interleave, negate) == (None, False, True, "", False)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 6, 32, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(2, 2, 6, 32, generator=g).to(dtype).requires_grad_(True)
    angles = torch.rand(2, 6, 16, generator=g) * 6
    got = _models._rope_wrapper(fn, rounds, partial, half)(q, k, angles.cos(), angles.sin())
    want = fn(q, k, angles.cos(), angles.sin())
    dys = [torch.randn(t.shape, generator=g).to(t.dtype) for t in want]
    for a, b in zip((*got, *torch.autograd.grad(got, (q, k), dys)), (*want, *torch.autograd.grad(want, (q, k), dys))):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


INTERLEAVED_ROPES = {   # family: (interleave, partial, negate), as found by running its apply_rotary_pos_emb
    "cohere": ("paired", False, False), "glm": ("split", True, False), "glm4": ("split", True, False),
    "ernie4_5": ("split", False, False), "helium": ("split", False, False),
    "nanochat": ("", False, True),   # (half-split pairs rotated the other way: its rotate_half gives (x2, -x1))
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(INTERLEAVED_ROPES))
def test_interleaved_ropes_are_found_by_running_them_and_computed_as_the_models_own(family, dtype):
    """Ropes that rotate pairs (2i, 2i + 1): Cohere's with tables that repeat each angle in
    place, GLM's, Ernie 4.5's and Helium's making such tables from Hugging Face's half-split ones
    (GLM's rotating the dims its tables cover); and nanochat's, half-split pairs rotated the other
    way: found so, and the wrapper's result on the tables each model's rotary embedding makes (full
    width, and for the partial ones a quarter of the head), forward and backward, is the model's
    own."""
    import functools

    modname = f"transformers.models.{family}.modeling_{family}"
    fn = importlib.import_module(modname).apply_rotary_pos_emb
    why, rounds, partial, half, interleave, negate = _recognize.recognize_rope(
        modname, fn, functools.partial(_models._rope_wrapper, fn), "cpu", dtype)
    assert (why, half, (interleave, partial, negate)) == (None, False, INTERLEAVED_ROPES[family])
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 6, 32, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(2, 2, 6, 32, generator=g).to(dtype).requires_grad_(True)
    for n in (16, 4) if partial else (16,):
        angles = torch.rand(2, 6, n, generator=g) * 6
        if interleave == "paired":
            cos, sin = (f(angles).repeat_interleave(2, -1) for f in (torch.cos, torch.sin))
        else:
            cos, sin = (torch.cat([f(angles)] * 2, -1) for f in (torch.cos, torch.sin))
        got = _models._rope_wrapper(fn, rounds, partial, half, interleave, negate)(q, k, cos, sin)
        want = fn(q, k, cos, sin)
        dys = [torch.randn(t.shape, generator=g).to(t.dtype) for t in want]
        for a, b in zip((*got, *torch.autograd.grad(got, (q, k), dys)),
                        (*want, *torch.autograd.grad(want, (q, k), dys))):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6 if dtype == torch.float32 else 2e-2)


def test_a_rope_that_rounds_to_qs_dtype_is_rounded_so_too():
    """With float32 tables and bfloat16 q (as autocast makes them), OLMo 2's rope rounds its
    result to q's dtype and LLaMA's keeps PyTorch's float32 promotion: each is matched."""
    import functools

    from cukern.torch import _models

    found = {}
    for family in ("olmo2", "llama"):
        modname = type(_tiny(family, torch.bfloat16).model).__module__
        fn = importlib.import_module(modname).apply_rotary_pos_emb
        why, rounds, *_ = _recognize.recognize_rope(modname, fn, functools.partial(_models._rope_wrapper, fn), "cpu",
                                                    torch.bfloat16)
        assert why is None
        found[family] = rounds
        q = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
        cos, sin = torch.rand(1, 3, 8), torch.rand(1, 3, 8)
        got = _models._rope_wrapper(fn, rounds)(q, q, cos, sin)
        assert got[0].dtype == fn(q, q, cos, sin)[0].dtype
    assert found == {"olmo2": True, "llama": False}


def test_the_checks_patch_runs_are_not_counted_as_the_models_calls(monkeypatch):
    import functools

    monkeypatch.setattr(_recognize, "_rope_cache", {})
    modname = type(_tiny("llama", torch.bfloat16).model).__module__
    fn = importlib.import_module(modname).apply_rotary_pos_emb
    wrap = functools.partial(_models._rope_wrapper, fn)
    ct.reset_counts()
    assert _recognize.recognize_rope(modname, fn, wrap, "cpu", torch.bfloat16)[0] is None
    assert "rope" not in ct.counts()
    q = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
    wrap(False, False)(q, q, torch.rand(1, 3, 8), torch.rand(1, 3, 8))   # (a model's call is counted)
    assert sum(ct.counts()["rope"].values()) == 1


# ---- the loss: the LM head found by what the logits are ---------------------------------------------

LM_HEAD = "loss: linear cross-entropy on the LM head"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_named_familys_loss_is_found_and_trains_as_its_own(family):
    """The causal LM's loss is routed where its logits are the LM head's of the last hidden state
    (Granite's scaled by 1 / logits_scaling, Gemma 2's softcapped): in float32 on the CPU, the
    patched model's loss and every gradient equal the model's own."""

    cfg_cls, model_cls, over, _ = FAMILIES[family]
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, **over)
    if family == "granite":
        base["logits_scaling"] = 4.0
    if family == "gemma2":   # (a cap the small logits reach: one that only a wrong route would miss)
        base["final_logit_softcapping"] = 0.5
    torch.manual_seed(0)
    a = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**base)).train()
    _loss_routed_trains_as_its_own(a, LM_HEAD + {"granite": ", logits times 0.25",
                                                 "gemma2": ", softcap 0.5"}.get(family, ""))


def _loss_routed_trains_as_its_own(a, want: str):
    """Model ``a`` and a copy with the loss alone routed (its decision ``want``): no logits, and
    the loss and every gradient the model's own, in float32 on the CPU."""
    import copy

    b = copy.deepcopy(a)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    la = a(input_ids=ids, labels=ids).loss
    la.backward()
    with ct.patch(b, parts=["loss"]):
        assert ct.routing(b)["(model)"] == want
        out = b(input_ids=ids, labels=ids)
        assert out.logits is None
        out.loss.backward()
    torch.testing.assert_close(out.loss, la, rtol=1e-5, atol=1e-5)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        if pa.grad is not None:
            torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_coheres_logit_scale_is_found_and_its_loss_trains_as_its_own():
    """Cohere's (and Cohere 2's) logits are the LM head's times the module's logit_scale."""
    torch.manual_seed(0)
    a = transformers.CohereForCausalLM(transformers.CohereConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=64, logit_scale=0.25, pad_token_id=0)).train()
    _loss_routed_trains_as_its_own(a, LM_HEAD + ", logits times 0.25")


def test_logits_that_are_not_the_heads_are_left_alone():
    """A causal LM whose logits are transformed in a way the config does not name (here: a
    temperature) keeps its own loss, with the reason."""
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=50, max_position_embeddings=32)

    class Tempered(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            out.logits = out.logits / 1.7
            return out

    m = Tempered(cfg)
    with ct.patch(m, parts=["loss"]):
        assert ct.routing(m)["(model)"].startswith("left alone: its logits are not the LM head's")
        assert "forward" not in m.__dict__


# ---- whole models: every part at once -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2",
                                  "granite", "gpt_neox", "starcoder2",
                                  # (families not named by the demo that compute the same things:
                                  # interleaved ropes, Cohere's logit_scale)
                                  "cohere", "cohere2", "glm", "glm4", "ernie4_5", "helium",
                                  # (nanochat's norms without a weight and its rope turned the other way)
                                  "nanochat"])
def test_each_demo_family_patched_whole_trains_as_its_own_on_the_cpu(kind):
    """``python -m cukern train-demo --model KIND``'s model, every part patched: in float32 on the
    CPU (where the routed calls run PyTorch's ops) the loss and every gradient equal the model's
    own, so each routing computes what the module did: Gemma's scaled embeddings, softcapped
    attention and logits, GLM's partial interleaved rope and Cohere's scaled logits included."""
    import copy

    from cukern.demo import hf, options

    torch.manual_seed(0)
    a = hf.build(options.Config(layers=2, dim=64, heads=4, seq=32, vocab=97, model=kind)).train()
    b = copy.deepcopy(a)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    la = a(input_ids=ids, labels=ids).loss
    la.backward()
    with ct.patch(b):
        decisions = ct.routing(b)
        lb = b(input_ids=ids, labels=ids).loss
        lb.backward()
    assert not [v for v in decisions.values() if v.startswith("left alone")], decisions
    assert any(v.startswith("loss: ") for v in decisions.values()) and any(v.startswith("norm: ") for v in
                                                                         decisions.values())
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        if pa.grad is not None:
            torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_a_scaled_embedding_is_found_and_a_look_alike_left_alone():
    class Scaled(nn.Embedding):   # (Gemma's: the lookup times sqrt(hidden) in the weight's dtype)
        def __init__(self):
            super().__init__(11, 6)
            self.embed_scale = 6 ** 0.5

        def forward(self, ids):
            return super().forward(ids) * torch.tensor(self.embed_scale, dtype=self.weight.dtype)

    class Shifted(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) + 1.0

    assert _recognize.recognize_embedding(nn.Embedding(5, 3)) == (1.0, None)
    assert _recognize.recognize_embedding(Scaled()) == (pytest.approx(6 ** 0.5), None)
    assert _recognize.recognize_embedding(Shifted(5, 3)) == (None, "its output is not the lookup times one scale")


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral", "qwen2"])
def test_windowed_layers_reach_the_kernels_route_whatever_the_family(family):
    """Sliding-window layers whose window hides keys: their mask is read for its window (one
    document a row), so the calls reach the kernels' route (on the CPU: PyTorch's, counted "not
    CUDA tensors" alone, never "a mask that is neither causal ..."), and the loss is the model's."""
    import copy

    cfg_cls, model_cls, over, _ = FAMILIES[family]
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=97, max_position_embeddings=64, sliding_window=4, **{"head_dim": 16, **over})
    if family == "gemma3":
        kw["layer_types"] = ["sliding_attention", "full_attention"]
    if family == "qwen2":
        kw.update(use_sliding_window=True, max_window_layers=0)
    c = getattr(transformers, cfg_cls)(**kw)
    c._attn_implementation = "eager"
    torch.manual_seed(0)
    a = getattr(transformers, model_cls)(c).train()
    b = copy.deepcopy(a)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    la = a(input_ids=ids, labels=ids).loss
    ct.reset_counts()
    with ct.patch(b):
        lb = b(input_ids=ids, labels=ids).loss
        counts = ct.counts(reasons=True)["attention"]
    assert counts["torch_reasons"] == {"not CUDA tensors": 2}, counts
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)


def test_a_tanh_gelu_written_out_is_found_by_running_it():
    import math

    class Written(nn.Module):   # (GPT-2's gelu_new, as transformers writes it)
        def forward(self, x):
            return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    class Erf(nn.Module):
        def forward(self, x):
            return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))

    class Needs2(nn.Module):
        def forward(self, x, y):
            return x + y

    assert _recognize.recognize_tanh_gelu(Written())
    assert not _recognize.recognize_tanh_gelu(Erf()) and not _recognize.recognize_tanh_gelu(Needs2())
    assert not _recognize.recognize_tanh_gelu(nn.GELU(approximate="tanh"))   # (PyTorch's own: not run)
    m = nn.Sequential(nn.Linear(4, 4), Written())
    with ct.patch(m, parts=["mlp"]):
        assert ct.routing(m)["1"] == "mlp: tanh GELU (PyTorch's fused)"
        x = torch.randn(3, 4)
        torch.testing.assert_close(m(x), m[1].__class__.forward(m[1], m[0](x)), rtol=1e-6, atol=1e-6)


def _as_its_own_in_bf16(la, ga, lb, gb) -> None:
    """A patched bf16 step's loss and gradients (lb, gb) as the model's own (la, ga) to bf16's
    rounding: the loss to 5e-3, each gradient to 5% of its largest element."""
    torch.testing.assert_close(lb, la, rtol=5e-3, atol=5e-3)
    for n in ga:
        assert (ga[n] - gb[n]).abs().max().item() <= 0.05 * (ga[n].abs().max().item() + 1e-6), n


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "gpt_neox",
                                  "starcoder2",
                                  # (interleaved ropes on the kernels: Cohere's paired tables, GLM-4's split ones)
                                  "cohere", "glm4", "ernie4_5"])
def test_each_demo_family_trains_on_the_kernels_like_its_own_on_the_gpu(kind):
    """The demo's model of each family (head dim 64), one bf16-autocast training step patched and
    not: every attention call, norm, embedding and the loss on the kernels, the loss and the
    gradients as the model's own to bf16's rounding."""
    (la, ga), (lb, gb), _, counts = _patched_step(kind, "cuda", torch.bfloat16, dim=256, seq=256, vocab=512)
    for part in ("attention", "embedding", "linear_cross_entropy"):
        assert counts[part]["cukern"] > 0 and counts[part]["torch"] == 0, (part, counts)
    if kind in ("cohere", "glm4", "ernie4_5"):
        assert counts["rope"]["cukern"] > 0 and counts["rope"]["torch"] == 0, counts
    assert any(counts.get(n, {}).get("cukern", 0) for n in ("rms_norm", "layer_norm")), counts
    # every norm, QK-norms and norms after a sublayer (bf16 inputs, float32 weights) included
    assert all(counts.get(n, {}).get("torch", 0) == 0 for n in ("rms_norm", "layer_norm")), counts
    _as_its_own_in_bf16(la, ga, lb, gb)


def _patched_step(kind, device, dtype=None, *, dim, seq, vocab, model=None):
    """The demo's model of ``kind`` (two layers, four heads), or ``model`` where given, and a
    patched copy: one training step of each on (2, seq) tokens, under autocast to ``dtype`` where
    given: ((loss, grads), (loss, grads), the patched one's routing decisions, its counts)."""
    import copy

    from cukern.demo import hf, options

    torch.manual_seed(0)
    a = model if model is not None else hf.build(options.Config(layers=2, dim=dim, heads=4, seq=seq, vocab=vocab,
                                                                model=kind))
    a = a.to(device).train()
    b = copy.deepcopy(a)
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1)).to(device)

    def step(m):
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.float(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}

    la, ga = step(a)
    ct.reset_counts()
    with ct.patch(b, min_size=0):
        decisions = ct.routing(b)
        lb, gb = step(b)
        counts = ct.counts(reasons=True)
    return (la, ga), (lb, gb), decisions, counts


def test_nanochats_rope_rotates_the_other_way_and_trains_as_its_own_on_the_cpu():
    """nanochat's rope (its rotate_half gives (x2, -x1): pairs (j, j + D/2) rotated the other way)
    is cukern's rope with sin negated: routed so, and in float32 on the CPU the loss and every
    gradient are the model's own."""
    (la, ga), (lb, gb), decisions, _ = _patched_step("nanochat", "cpu", dim=64, seq=64, vocab=97)
    assert decisions["transformers.models.nanochat.modeling_nanochat.apply_rotary_pos_emb"] == \
        "rope: cukern's rope, rotated the other way (sin negated)"
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.gpu
def test_nanochats_rope_trains_on_the_kernel_like_its_own_on_the_gpu():
    """The same under bf16 autocast with the rope on the kernel: the loss and the gradients as the
    model's own to bf16's rounding."""
    (la, ga), (lb, gb), _, counts = _patched_step("nanochat", "cuda", torch.bfloat16, dim=256, seq=64, vocab=97)
    assert counts["rope"]["cukern"] > 0 and counts["rope"]["torch"] == 0, counts
    _as_its_own_in_bf16(la, ga, lb, gb)


# ---- norms without a weight (nanochat's), ropes of one tensor a call (GPT-J's, CodeGen's) ----------

NANOCHAT_NORMS = ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm")


def test_nanochats_norms_without_a_weight_are_found_and_train_as_their_own_on_the_cpu():
    """nanochat's RMSNorm has no weight (x in float32, rounded once to x's dtype): found by
    running it on float32, bfloat16 and float16 inputs, routed (every call counted: four a layer
    and the final norm, run twice), and in float32 on the CPU the loss and every gradient are the
    model's own."""
    (la, ga), (lb, gb), decisions, counts = _patched_step("nanochat", "cpu", dim=64, seq=64, vocab=97)
    norms = [f"model.layers.{i}.{n}" for i in range(2) for n in NANOCHAT_NORMS] + ["model.norm"]
    assert {n: decisions.get(n) for n in norms} == dict.fromkeys(norms, "norm: RMSNorm without weight")
    assert not [v for v in decisions.values() if v.startswith("left alone")], decisions
    assert counts["rms_norm"] == {"cukern": 0, "torch": 10, "torch_reasons": {"not a CUDA tensor": 10}}
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-5, msg=n)


class Weightless(nn.Module):
    """An RMSNorm without a weight as nanochat writes it, its eps ``used`` in the forward."""

    def __init__(self, eps=1e-6, used=None):
        super().__init__()
        self.eps, self.used = eps, eps if used is None else used

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.used)).type_as(x)


class WeightlessLayerNorm(Weightless):
    def forward(self, x):
        return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], eps=self.eps).type_as(x)


class Doubled(Weightless):
    def forward(self, x):
        return 2 * super().forward(x)


class WithBuffer(Weightless):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))


def test_norms_without_a_weight_that_compute_something_else_are_left_alone_with_the_reason():
    """A norm without a weight routes only where it agrees with a variant in float32, bfloat16
    and float16 alike: one that adds another eps than its attribute says, or scales its result, is
    left alone with the reason; a module with a buffer (state a probe could move) is not run."""
    _recognize._cache.clear()
    model = nn.Sequential(Weightless(), WeightlessLayerNorm(1e-5), Weightless(1e-6, used=1e-3), Doubled(),
                          WithBuffer())
    x = torch.randn(2, 5, 32)
    expect = model(x)
    with ct.patch(model, parts=["norm"]):
        got = ct.routing(model)
        assert got["0"] == "norm: RMSNorm without weight"
        assert got["1"] == "norm: LayerNorm without weight or bias"
        for i in ("2", "3"):
            assert got[i] == ("left alone: computes none of cukern's norms without a weight (RMSNorm, LayerNorm) to "
                              "the rounding of float32, bfloat16 and float16 alike"), (i, got[i])
        assert "4" not in got
        assert [("forward" in m.__dict__) for m in model] == [True, True, False, False, False]
        torch.testing.assert_close(model(x), expect, rtol=0, atol=0)


@pytest.mark.parametrize("casting", ["gemma", "none"])
def test_the_candidates_without_a_weight_are_the_norm_kernels_arithmetic(casting):
    from test_torch_autograd import TORCH_OWN

    from cukern.norm.configs import CASTING_MODES

    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    v = _recognize.NormVariant("rms", 0.0, CASTING_MODES[casting], False, 1e-5, weight=False)
    expect = TORCH_OWN["rms_norm"](x, None, 1e-5, 0.0, CASTING_MODES[casting])[0]
    torch.testing.assert_close(_recognize.candidate(v, x, None, None), expect, rtol=0, atol=0)


GPTJ_FORM = _recognize.OneTensorRope(sin_first=True, seq_first=True, half=True, interleaved=True)
ONE_TENSOR_ROPES = {"gptj": ("GPTJConfig", "GPTJForCausalLM"), "codegen": ("CodeGenConfig", "CodeGenForCausalLM")}


def _one_tensor_rope_model(family: str, rotary_dim: int, dim: int = 64):
    """A two-layer GPT-J or CodeGen of four heads, ``rotary_dim`` of each head rotated."""
    cfg_cls, model_cls = ONE_TENSOR_ROPES[family]
    c = getattr(transformers, cfg_cls)(n_embd=dim, n_layer=2, n_head=4, rotary_dim=rotary_dim, vocab_size=97,
                                       n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=1, eos_token_id=1)
    c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(ONE_TENSOR_ROPES))
def test_ropes_of_one_tensor_are_found_by_running_them_and_computed_as_the_models_own(family, dtype):
    """GPT-J's and CodeGen's apply_rotary_pos_emb(tensor, sin, cos) rotate one (B, S, H, D) tensor
    a call, pairs (2i, 2i + 1), with tables of half its width: found so by running it, and the
    wrapper's result (the tables repeated in place, the kernel given one head of x as its k) on
    the slice of a wider head their attention hands it, forward and backward, with tables of x's
    dtype and float32 ones, is the model's own."""
    import functools

    modname = f"transformers.models.{family}.modeling_{family}"
    fn = importlib.import_module(modname).apply_rotary_pos_emb
    form, why = _recognize.recognize_rope_one(modname, fn, functools.partial(_models._rope_one_wrapper, fn), "cpu",
                                              dtype)
    assert (form, why) == (GPTJ_FORM, None)
    g = torch.Generator().manual_seed(8)
    head = torch.randn(2, 6, 4, 32, generator=g).to(dtype).requires_grad_(True)
    angles = torch.rand(2, 6, 8, generator=g) * 6
    for tables in (torch.float32, dtype):
        sin, cos = angles.sin().to(tables), angles.cos().to(tables)
        got = _models._rope_one_wrapper(fn, form)(head[..., :16], sin, cos)
        want = fn(head[..., :16], sin, cos)
        dy = torch.randn(want.shape, generator=g).to(want.dtype)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if dtype == torch.float32 else 2e-2)
        torch.testing.assert_close(torch.autograd.grad(got, head, dy)[0], torch.autograd.grad(want, head, dy)[0],
                                   rtol=0, atol=1e-6 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("rotary_dim", [8, 16])
@pytest.mark.parametrize("family", sorted(ONE_TENSOR_ROPES))
def test_gptj_and_codegen_ropes_are_routed_and_train_as_their_own_on_the_cpu(family, rotary_dim):
    """GPT-J and CodeGen, a part of each head rotated (as the released models) or all of it:
    every part routed, the rope called for q and k of each layer (counted), and in float32 on the
    CPU the loss and every gradient are the model's own."""
    model = _one_tensor_rope_model(family, rotary_dim)
    (la, ga), (lb, gb), decisions, counts = _patched_step(family, "cpu", dim=64, seq=12, vocab=97, model=model)
    assert decisions[f"transformers.models.{family}.modeling_{family}.apply_rotary_pos_emb"] == \
        "rope: cukern's rope, interleaved pairs, one tensor a call (x, sin, cos), half-width tables"
    assert not [v for v in decisions.values() if v.startswith("left alone")], decisions
    assert counts["rope"] == {"cukern": 0, "torch": 4,
                              "torch_reasons": {"not CUDA (B, H, S, D) q and k with (B, S, D) cos and sin": 4}}
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-5, msg=n)


def _gptj_rotate(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def test_ropes_of_one_tensor_that_differ_are_left_alone_and_other_orders_found():
    """The one-tensor probe decides by running: GPT-J's form turned the other way, or with its
    tables' halves swapped (half-split pairs), is left alone with the reason; the tables taken
    (cos, sin), full width, on (B, H, S, D) x, is found so; a function of neither signature says so."""
    def gptj_like(sign=1.0, pairs=True):
        def apply_rotary_pos_emb(tensor, sin, cos):
            rep = (lambda t: torch.repeat_interleave(t[:, :, None, :], 2, 3)) if pairs else \
                (lambda t: torch.cat([t, t], -1)[:, :, None, :])
            return tensor * rep(cos) + sign * _gptj_rotate(tensor) * rep(sin)
        return apply_rotary_pos_emb

    def cos_first_heads_first(x, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def neither(x):
        return x

    _recognize._rope_one_cache.clear()
    got = {name: _models._rope_for(f"test.one_tensor.{name}", fn, "cpu", torch.float32)[1]
           for name, fn in (("backwards", gptj_like(-1.0)), ("split", gptj_like(pairs=False)),
                            ("cos_first", cos_first_heads_first), ("neither", neither), ("gptj", gptj_like()))}
    differs = "left alone: its rotation is not cukern's rope (half-split or interleaved) to the dtype's rounding"
    assert got == {
        "backwards": differs, "split": differs,
        "cos_first": "rope: cukern's rope, one tensor a call (x, cos, sin)",
        "neither": "left alone: its apply_rotary_pos_emb takes neither (q, k, cos, sin) nor (x, cos, sin) (TypeError)",
        "gptj": "rope: cukern's rope, interleaved pairs, one tensor a call (x, sin, cos), half-width tables"}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gptj", "codegen", "nanochat"])
def test_gptj_codegen_and_nanochat_train_on_the_kernels_like_their_own_on_the_gpu(kind):
    """The demo's GPT-J, CodeGen and nanochat (head dim 64, all of it rotated), one bf16-autocast
    training step patched and not: every rope call on the kernel (GPT-J's and CodeGen's one
    tensor a call, nanochat's the other way), nanochat's norms without a weight too, the loss and
    the gradients as the model's own to bf16's rounding."""
    (la, ga), (lb, gb), decisions, counts = _patched_step(kind, "cuda", torch.bfloat16, dim=256, seq=64, vocab=97)
    assert not [v for v in decisions.values() if v.startswith("left alone")], decisions
    assert counts["rope"]["cukern"] > 0 and counts["rope"]["torch"] == 0, counts
    if kind == "nanochat":
        assert counts["rms_norm"] == {"cukern": 10, "torch": 0}, counts
    _as_its_own_in_bf16(la, ga, lb, gb)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(ONE_TENSOR_ROPES))
def test_gptj_and_codegens_partial_rope_trains_on_the_kernel_like_its_own_on_the_gpu(family):
    """A part of each head rotated (32 of 64, as the released models rotate a part): the kernel
    rotates the slice the attention hands it, the loss and gradients as the model's own."""
    model = _one_tensor_rope_model(family, 32, dim=256)
    (la, ga), (lb, gb), _, counts = _patched_step(family, "cuda", torch.bfloat16, dim=256, seq=64, vocab=97,
                                                  model=model)
    assert counts["rope"] == {"cukern": 4, "torch": 0}, counts
    _as_its_own_in_bf16(la, ga, lb, gb)


# ---- scaled rotary tables: LLaMA 3's and YaRN's ----------------------------------------------------

ROPE_SCALING = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    # (YaRN also scales the tables' magnitude: attention_scaling 1.14 at factor 4)
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
}


def _scaled_llama(kind: str, device="cpu"):
    c = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=512,
                                 rope_parameters=ROPE_SCALING[kind])
    c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(c).to(device)


@pytest.mark.parametrize("kind", sorted(ROPE_SCALING))
def test_scaled_rotary_tables_are_routed_and_train_as_the_models_own_on_the_cpu(kind):
    """The rope is found by running the modeling module's function, whatever tables the model
    makes: LLaMA 3's and YaRN's scaled ones reach the route, and the patched model's loss and
    gradients (float32, CPU) are its own."""
    import copy

    a = _scaled_llama(kind)
    b = copy.deepcopy(a)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    a(input_ids=ids, labels=ids).loss.backward()
    ct.reset_counts()
    with ct.patch(b):
        assert ct.routing(b)["transformers.models.llama.modeling_llama.apply_rotary_pos_emb"] == "rope: cukern's rope"
        b(input_ids=ids, labels=ids).loss.backward()
        assert sum(ct.counts()["rope"].values()) == 2
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(ROPE_SCALING))
def test_scaled_rotary_tables_train_on_the_kernels_as_the_models_own_on_the_gpu(kind):
    import copy

    a = _scaled_llama(kind, "cuda")
    b = copy.deepcopy(a)
    ids = torch.randint(0, 97, (2, 384), generator=torch.Generator().manual_seed(3)).cuda()

    def step(m):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.float(), {n: p.grad.float() for n, p in m.named_parameters()}

    la, ga = step(a)
    ct.reset_counts()
    with ct.patch(b, min_size=0):
        lb, gb = step(b)
        assert ct.counts()["rope"] == {"cukern": 2, "torch": 0}
    _as_its_own_in_bf16(la, ga, lb, gb)


@pytest.mark.parametrize("kind", ["qwen3", "mixtral"])
def test_a_patched_family_compiles_to_one_graph_on_the_cpu(kind):
    """torch.compile of a patched model: the routed forwards trace without a graph break (the
    ops they call were looked up through a cache Dynamo traces into, which broke every layer into
    graphs of its own and, past the recompile limit, left the rest eager)."""
    from cukern.demo import hf, options

    torch.manual_seed(0)
    m = hf.build(options.Config(layers=1, dim=64, heads=4, seq=32, vocab=97, model=kind)).train()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with ct.patch(m):
        explained = torch._dynamo.explain(m)(input_ids=ids, labels=ids)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]


# ---- mixture-of-experts: the experts ---------------------------------------------------------------

MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")


def _moe_model(kind: str, layers: int = 2, device="cpu"):
    c = transformers.AutoConfig.for_model(kind, hidden_size=32, intermediate_size=16, moe_intermediate_size=16,
                                          num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                          vocab_size=53, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
                                          head_dim=16, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(c).to(device).train()


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_moe_experts_are_found_by_what_they_compute_and_train_as_their_own_on_the_cpu(kind):
    """Each family's fused experts are found (run against each activation on a random input);
    on the CPU the routed forward runs their own code, counted, and the model's loss and every
    gradient are its own."""
    import copy

    a = _moe_model(kind)
    b = copy.deepcopy(a)
    ids = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(1))
    a(input_ids=ids, labels=ids).loss.backward()
    ct.reset_counts()
    with ct.patch(b):
        decisions = ct.routing(b)
        b(input_ids=ids, labels=ids).loss.backward()
        counts = ct.counts(reasons=True)["moe"]
    assert [decisions[f"model.layers.{i}.mlp.experts"] for i in range(2)] == \
        ["moe: grouped experts, swiglu (gate rows first)"] * 2
    assert counts == {"cukern": 0, "torch": 2, "torch_reasons": {"not on a CUDA device": 2}}
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=0, atol=0, msg=n)


def test_experts_that_compute_something_else_are_left_alone_with_the_reason():
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=4)

    class Relu(MixtralExperts):   # (an activation cukern's products do not take)
        def __init__(self):
            super().__init__(cfg)
            self.act_fn = nn.ReLU()

    class UpFirst(MixtralExperts):   # (the up rows first: gate and up swapped)
        def forward(self, x, top_k_index, top_k_weights):
            i = self.gate_up_proj.shape[1] // 2
            swapped = torch.cat([self.gate_up_proj[:, i:], self.gate_up_proj[:, :i]], dim=1)
            return _recognize_experts.experts_reference("silu", x, top_k_index, top_k_weights, swapped, self.down_proj)

    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 32, 32))
            self.down_proj = nn.Parameter(torch.randn(4, 16, 32))

    for m, why in ((Relu(), "computes no gated experts"), (UpFirst(cfg), "computes no gated experts"),
                   (Transposed(), "its weights are (4, 32, 32) and (4, 16, 32), not (E, 2I, H)")):
        m.config = cfg
        m.config._experts_implementation = "eager"
        assert _recognize_experts.experts_shaped(m)
        spec, reason = _recognize_experts.recognize_experts(m)
        assert spec is None and reason.startswith(why), reason
    gpt_oss = _gpt_oss_model()
    with torch.no_grad():   # (a bias of another shape: its parameters, not biased experts)
        gpt_oss.model.layers[0].mlp.experts.down_proj_bias = nn.Parameter(torch.zeros(4, 31))
    with ct.patch(gpt_oss):
        assert ct.routing(gpt_oss)["model.layers.0.mlp.experts"].startswith(
            "left alone: its weights and biases are (4, 32, 32), (4, 32), (4, 16, 32) and (4, 31)")


def _gpt_oss_model(layers: int = 1, device="cpu"):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=53, num_local_experts=4, num_experts_per_tok=2)).to(device).train()


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_gpt_oss_experts_are_found_with_their_clamped_gate_and_train_as_their_own_on_the_cpu(implementation):
    """GPT-OSS's experts (weights (E, in, out), gate and up interleaved, biases, the clamped gate)
    are found with the config's alpha and limit under either of transformers' implementations;
    on the CPU the routed forward runs their own code, counted, and the loss and every gradient
    are the model's own. A gate that is not the clamped one (another limit than the attribute
    says) is left alone with the reason."""
    import copy

    a = _gpt_oss_model(layers=2)
    a.config._experts_implementation = implementation
    b = copy.deepcopy(a)
    ids = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(1))
    a(input_ids=ids, labels=ids).loss.backward()
    ct.reset_counts()
    with ct.patch(b, parts=["moe"]):
        decisions = ct.routing(b)
        b(input_ids=ids, labels=ids).loss.backward()
        counts = ct.counts(reasons=True)["moe"]
    assert [decisions[f"model.layers.{i}.mlp.experts"] for i in range(2)] == \
        ["moe: grouped experts with biases, clamped swiglu (alpha 1.702, limit 7; gate and up interleaved)"] * 2
    assert counts == {"cukern": 0, "torch": 2, "torch_reasons": {"not on a CUDA device": 2}}
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=0, atol=0, msg=n)
    other = _gpt_oss_model()
    other.model.layers[0].mlp.experts.limit = 3.0   # (its _apply_gate reads it: found with 3)
    with ct.patch(other):
        assert "limit 3;" in ct.routing(other)["model.layers.0.mlp.experts"]
    lying = _gpt_oss_model()
    lying.config._experts_implementation = "eager"
    experts = lying.model.layers[0].mlp.experts

    def unclamped(self, gate_up):   # (equal to the clamped gate wherever the gate is under the limit)
        gate, up = gate_up[..., ::2], gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    experts._apply_gate = types.MethodType(unclamped, experts)
    spec, why = _recognize_experts._probe_biased(experts, _recognize_experts.BiasedExperts(1.702, 7.0), 4, 16, 32)
    assert spec is None and why.startswith("computes no biased experts with the clamped gate (alpha 1.702, limit 7)")


@pytest.mark.gpu
def test_gpt_oss_experts_train_on_the_kernels_like_their_own_on_the_gpu():
    """One GPT-OSS layer, the experts alone routed, bf16 autocast, widths the grouped kernels
    take on every path (hidden 128, 2I 256, 300 tokens): the loss and every gradient (the
    biases' and the router's included) agree with the model's own code to bf16's rounding."""
    torch.manual_seed(0)
    a = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, vocab_size=97, num_local_experts=8, num_experts_per_tok=2)).cuda().train()
    with torch.no_grad():   # (biases and weights of a trained size; gate inputs of a few units, under
        # the limit: the model's own products run in float32 here, and a rounding that moves a gate
        # input across the limit changes its gradient by a whole term; test_moe_block.py tests the clamps)
        ex = a.model.layers[0].mlp.experts
        ex.gate_up_proj.normal_(0, 0.1)
        ex.gate_up_proj_bias.normal_(0, 0.5)
        ex.down_proj.normal_(0, 0.05)
        ex.down_proj_bias.normal_(0, 0.1)
    ids = torch.randint(0, 97, (3, 100), generator=torch.Generator().manual_seed(1)).cuda()
    _experts_alone_routed_train_alike(a, ids, "moe: grouped experts with biases")


def _experts_alone_routed_train_alike(a, ids, routed_as: str = "moe: "):
    """Model ``a`` and a copy of it with its experts alone routed (decided ``routed_as``), one
    bf16-autocast step each on ``ids``: every experts call on the kernels, the loss and every
    gradient within bf16's rounding."""
    import copy

    b = copy.deepcopy(a)

    def step(m):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach().float()

    la = step(a)
    ct.reset_counts()
    with ct.patch(b, parts=["moe"]):
        assert ct.routing(b)["model.layers.0.mlp.experts"].startswith(routed_as)
        lb = step(b)
        assert ct.counts(reasons=True)["moe"] == {"cukern": 1, "torch": 0}
    torch.testing.assert_close(lb, la, rtol=5e-3, atol=5e-3)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        scale = pa.grad.abs().max().item() + 1e-6
        assert (pb.grad - pa.grad).abs().max().item() <= 0.05 * scale, n


@pytest.mark.gpu
@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_moe_experts_train_on_the_kernels_like_their_own_on_the_gpu(kind):
    """One layer, the experts alone routed, bf16 autocast: the router sees the same input in
    both runs (no expert choice can differ), and the loss and every gradient (the router's
    through the weights) agree to bf16's rounding; every experts call ran on the kernels."""
    a = _moe_model(kind, layers=1, device="cuda")
    ids = torch.randint(0, 53, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    _experts_alone_routed_train_alike(a, ids)


def test_experts_with_a_clamped_gate_another_activation_or_frozen_weights():
    """A gate of its own (``_apply_gate``) or a clamp that shows only on large inputs is left
    alone; a model whose config names another activation is found with that one (not the first
    model's, from a cache); frozen weights (as under LoRA) are probed without error."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=4)
    cfg._experts_implementation = "eager"

    class OwnGate(MixtralExperts):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=10.0)) * up

    class Clamped(MixtralExperts):   # (a clamp in its own forward: equal on inputs of unit size)
        def forward(self, x, top_k_index, top_k_weights):
            hid = torch.einsum("th,tkoh->tko", x, self.gate_up_proj[top_k_index])
            i = hid.shape[-1] // 2
            z = torch.nn.functional.silu(hid[..., :i].clamp(-10.0, 10.0)) * hid[..., i:]
            y = torch.einsum("tki,tkhi->tkh", z, self.down_proj[top_k_index])
            return (y * top_k_weights[..., None]).sum(1)

    for m, why in ((OwnGate(cfg), "its gate is its own"), (Clamped(cfg), "computes no")):
        m.config = cfg
        spec, reason = _recognize_experts.recognize_experts(m)
        assert spec is None and reason.startswith(why), reason
    assert _recognize_experts.recognize_experts(MixtralExperts(cfg)) == (_recognize_experts.Experts("silu"), None)
    gelu = transformers.MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=4, hidden_act="gelu")
    gelu._experts_implementation = "eager"
    assert _recognize_experts.recognize_experts(MixtralExperts(gelu)) == (_recognize_experts.Experts("gelu"), None)
    frozen = _moe_model("mixtral", layers=1).requires_grad_(False)
    with ct.patch(frozen):
        assert ct.routing(frozen)["model.layers.0.mlp.experts"].startswith("moe: ")
        assert ct.routing(frozen)["model.layers.0.input_layernorm"].startswith("norm: ")
    assert not any(p.requires_grad for p in frozen.parameters())
