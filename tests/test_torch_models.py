"""``cukern.torch.patch(model)`` on Hugging Face GPT-2, LLaMA and Mistral models built from tiny
configs: on the CPU (everything falls back but the loss path, whose structure runs), the
routing, the restoring, the state_dict and the masks; on the GPU, patched against unpatched
(outputs, losses, gradients) with every part counted on cukern's kernels."""
from __future__ import annotations

import copy
import dataclasses
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cukern.torch as ct  # noqa: E402
from cukern.torch import _models  # noqa: E402
from cukern.torch import _transformers_attention as _attention  # noqa: E402

VOCAB = 97


def _config(kind: str, **over):
    # Head dims of 64: the attention kernels' smallest (on the GPU every part is routed).
    if kind == "gpt2":
        c = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2, n_positions=256, vocab_size=VOCAB,
                                    attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    elif kind == "llama":
        c = transformers.LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                     max_position_embeddings=256, rms_norm_eps=1e-5)
    else:
        c = transformers.MistralConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=256, sliding_window=4096)
    for k, v in over.items():
        setattr(c, k, v)
    c._attn_implementation = "sdpa"
    return c


def _model(kind: str, device="cpu", seed=0, **over):
    torch.manual_seed(seed)
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
           "mistral": transformers.MistralForCausalLM}[kind]
    m = cls(_config(kind, **over)).to(device)
    with torch.no_grad():   # (random norms weights: a norm with unit weight hides a swapped operand)
        for name, p in m.named_parameters():
            if "norm" in name or "ln_" in name:
                p.uniform_(0.5, 1.5)
    return m.train()


def _ids(b, s, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=g).to(device)


KINDS = ("gpt2", "llama", "mistral")


# ---- CPU: routing, restoring, the loss path ----------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_patched_model_trains_like_the_original_on_the_cpu(kind):
    a = _model(kind)
    b = copy.deepcopy(a)
    ids = _ids(2, 24)
    la = a(input_ids=ids, labels=ids).loss
    la.backward()
    ct.reset_counts()
    with ct.patch(b):
        out = b(input_ids=ids, labels=ids)
        out.loss.backward()
        assert out.logits is None   # (training with labels: no logits, as Liger's)
        counts = ct.counts(reasons=True)
    assert counts["linear_cross_entropy"]["torch_reasons"] == {"not a CUDA tensor": 1}
    if kind == "gpt2":   # (gelu_new as PyTorch's tanh GELU: counted on the CPU too)
        assert counts["gelu"]["torch_reasons"] == {"not a CUDA tensor": 2}
    for name in ("embedding", "attention") + (("layer_norm",) if kind == "gpt2" else ("rms_norm", "rope", "swiglu")):
        assert counts[name]["torch"] > 0 and counts[name]["cukern"] == 0, (name, counts)
    # (GPT-2's gelu_new becomes the tanh GELU: the same function, other roundings)
    tol = 1e-5 if kind == "gpt2" else 1e-6
    torch.testing.assert_close(out.loss, la, rtol=tol, atol=tol)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("kind", KINDS)
def test_patch_keeps_the_state_dict_and_unpatch_restores_the_model(kind):
    m = _model(kind)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    mod = __import__(type(m).__module__, fromlist=["x"])
    rope_before = getattr(mod, "apply_rotary_pos_emb", None)
    p = ct.patch(m)
    assert ct.is_patched(m) and m.config._attn_implementation == "cukern"
    assert list(m.state_dict()) == list(before)
    patched = [x for x in m.modules() if "forward" in x.__dict__]
    assert patched, "no module routed"
    if kind != "gpt2":
        assert mod.apply_rotary_pos_emb.cukern_own is rope_before   # (cukern's, in front of the model's)
    ct.patch(m)   # nested: one more unpatch needed
    p.__exit__(None, None, None)
    assert ct.is_patched(m)
    ct.unpatch(m)
    assert not ct.is_patched(m) and m.config._attn_implementation == "sdpa"
    assert not [x for x in m.modules() if "forward" in x.__dict__]
    assert getattr(mod, "apply_rotary_pos_emb", None) is rope_before
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_patch_routes_the_modules_each_model_has():
    routed = {}
    for kind in KINDS:
        m = _model(kind)
        with ct.patch(m):
            routed[kind] = sorted({type(x).__name__ for x in m.modules() if "forward" in x.__dict__})
    assert routed["gpt2"] == ["Embedding", "GPT2LMHeadModel", "LayerNorm", "NewGELUActivation"]
    assert routed["llama"] == ["Embedding", "LlamaForCausalLM", "LlamaMLP", "LlamaRMSNorm"]
    assert routed["mistral"] == ["Embedding", "MistralForCausalLM", "MistralMLP", "MistralRMSNorm"]


def test_parts_choose_what_is_routed():
    m = _model("llama")
    with ct.patch(m, parts=("norm",)):
        assert sorted({type(x).__name__ for x in m.modules() if "forward" in x.__dict__}) == ["LlamaRMSNorm"]
        assert m.config._attn_implementation == "sdpa"


def test_bad_arguments_are_named():
    m = _model("llama")
    with pytest.raises(ValueError, match="parts"):
        ct.patch(m, parts=("norms",))
    with pytest.raises(ValueError, match="ops"):
        ct.patch(m, ops=("layer_norm",))
    with pytest.raises(ValueError, match="parts"):
        ct.patch(parts=("norm",))
    with pytest.raises(TypeError, match="min_size"):
        ct.patch(m, min_size="big")
    assert not ct.is_patched(m)
    with pytest.raises(TypeError, match="model"):
        _models.patch_model(object())


def test_the_loss_path_honours_num_items_shift_labels_and_ignore_index():
    a = _model("llama")
    b = copy.deepcopy(a)
    ids = _ids(2, 20)
    labels = ids.clone()
    labels[0, :5] = -100
    n = torch.tensor(17)
    want = a(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    shift = torch.roll(ids, -1, 1)
    want_shift = a(input_ids=ids, labels=labels, shift_labels=shift).loss
    with ct.patch(b):
        got = b(input_ids=ids, labels=labels, num_items_in_batch=n).loss
        got_shift = b(input_ids=ids, labels=labels, shift_labels=shift).loss
        tup = b(input_ids=ids, labels=labels, return_dict=False)
        b.eval()
        ev = b(input_ids=ids, labels=labels)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_shift, want_shift, rtol=1e-6, atol=1e-6)
    assert isinstance(tup, tuple) and torch.is_tensor(tup[0])
    assert ev.logits is not None and ev.logits.shape == (2, 20, VOCAB)   # (eval: logits kept)


# ---- the masks ---------------------------------------------------------------------------------

def _mask(config, attention_mask, s, position_ids=None):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    b = next((t.shape[0] for t in (attention_mask, position_ids) if t is not None), 2)
    emb = torch.zeros((b, s, 8))
    fn = create_sliding_window_causal_mask if getattr(config, "sliding_window", None) and \
        config.model_type == "mistral" else create_causal_mask
    return fn(config=config, inputs_embeds=emb, attention_mask=attention_mask, cache=None,
              position_ids=position_ids if position_ids is not None else torch.arange(s)[None])


def test_the_mask_function_gives_causal_key_padding_or_sdpa_masks():
    _attention.register()
    cfg = _config("llama")
    cfg._attn_implementation = "cukern"
    s = 12
    assert _mask(cfg, None, s) is None
    assert _mask(cfg, torch.ones((2, s), dtype=torch.long), s) is None
    pad = torch.ones((2, s), dtype=torch.long)
    pad[0, 9:] = 0    # right padding
    pad[1, :3] = 0    # left padding
    got = _mask(cfg, pad, s)
    assert got.dtype == torch.bool and got.shape == (2, s) and torch.equal(got, pad.bool())
    # packed documents (positions restarting): SDPA's 4D mask, marked with its documents
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]).expand(2, -1)
    packed = _mask(cfg, None, s, position_ids=pos)
    assert packed is not None and packed.dim() == 4
    cu, longest, window = packed._cukern_documents
    assert cu.tolist() == [0, 4, 12, 16, 24] and longest == 8 and window is None
    cfg.sliding_window = None


def _packed_positions(lengths_per_row):
    return torch.tensor([[p for n in row for p in range(n)] for row in lengths_per_row])


@pytest.mark.parametrize("seed", range(6))
def test_packed_documents_are_read_from_the_mask(seed):
    """Random documents a row (lengths 1 up to the row), with and without Mistral's window:
    the documents marked on SDPA's mask are the ones the position ids give; a mask that is
    not causal within documents gets no mark."""
    _attention.register()
    g = torch.Generator().manual_seed(seed)
    s, b = 24, 3
    rows = []
    for _ in range(b):
        left, row = s, []
        while left:
            n = int(torch.randint(1, left + 1, (1,), generator=g)) if seed % 2 else min(left, 1 + seed)
            row.append(n)
            left -= n
        rows.append(row)
    rows[0] = [s]     # (one row of a single document, as packing leaves some)
    pos = _packed_positions(rows)
    starts = [r * s + sum(row[:j]) for r, row in enumerate(rows) for j in range(len(row))]
    for window in (None, 5):
        cfg = _config("mistral", sliding_window=window)
        cfg._attn_implementation = "cukern"
        mask = _mask(cfg, None, s, position_ids=pos)
        if mask is None:   # (only one document a row and no window: causal)
            assert all(len(row) == 1 for row in rows)
            continue
        cu, longest, w = mask._cukern_documents
        assert cu.tolist() == starts + [b * s] and longest == max(max(row) for row in rows) and w == window
        broken = mask.clone()
        broken[1, 0, s - 1, 0] = ~broken[1, 0, s - 1, 0]
        assert _attention._documents(broken, window) is None
    # a non-causal document mask (bidirectional within documents) is not taken
    doc = torch.repeat_interleave(torch.arange(4), 6)
    bidir = (doc[:, None] == doc[None, :])[None, None].expand(2, 1, s, s)
    assert _attention._documents(bidir, None) is None


def test_the_dense_mask_of_key_padding_is_sdpas():
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    s = 10
    pad = torch.ones((3, s), dtype=torch.bool)
    pad[0, 7:] = False
    pad[1, :4] = False
    pad[2, 2] = False
    for window in (None, 4):
        cfg = _config("mistral", sliding_window=window)
        fn = create_sliding_window_causal_mask if window else create_causal_mask
        want = fn(config=cfg, inputs_embeds=torch.zeros((3, s, 8)), attention_mask=pad, cache=None,
                  position_ids=torch.arange(s)[None])
        got = _attention._dense_mask(pad, s, True, window)
        assert torch.equal(got, want.expand_as(got)), window


def test_sliding_window_masks_are_read_for_their_window():
    """A window that hides keys: SDPA's mask, found to be causal within the window (one document
    a row), whatever the model; a window wider than the sequence: the plain causal mask."""
    _attention.register()
    from transformers.masking_utils import create_sliding_window_causal_mask

    for kind in ("mistral", "llama"):
        cfg = _with(_config(kind), sliding_window=4)
        cfg._attn_implementation = "cukern"
        m = create_sliding_window_causal_mask(config=cfg, inputs_embeds=torch.zeros((2, 12, 8)), attention_mask=None,
                                              cache=None, position_ids=torch.arange(12)[None])
        assert m is not None and m.dim() == 4
        cu, longest, window = m._cukern_documents
        assert cu.tolist() == [0, 12, 24] and longest == 12 and window == 4
        wide = create_sliding_window_causal_mask(config=_with(cfg, sliding_window=40),
                                                 inputs_embeds=torch.zeros((2, 12, 8)), attention_mask=None,
                                                 cache=None, position_ids=torch.arange(12)[None])
        assert wide is None


def _with(cfg, **kw):
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


# ---- GPU: patched against unpatched ---------------------------------------------------------------

def _train_step(m, ids, labels, attention_mask=None, position_ids=None):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = m(input_ids=ids, labels=labels, attention_mask=attention_mask, position_ids=position_ids)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad.detach().float().clone() for n, p in m.named_parameters()}


def _against_pytorch(kind, ids, labels=None, pad=None, position_ids=None, **over):
    """One training step of a model and of its patched copy: (loss, grads, loss, grads, counts)."""
    a = _model(kind, "cuda", **over)
    b = copy.deepcopy(a)
    labels = ids if labels is None else labels
    la, ga = _train_step(a, ids, labels, pad, position_ids)
    ct.reset_counts()
    with ct.patch(b, min_size=0):
        lb, gb = _train_step(b, ids, labels, pad, position_ids)
        counts = ct.counts(reasons=True)
    return la, ga, lb, gb, counts


def _close_grads(ga, gb, rel):
    bad = []
    for n in ga:
        scale = ga[n].abs().max().item() + 1e-6
        err = (ga[n] - gb[n]).abs().max().item()
        if not err <= rel * scale:
            bad.append(f"{n}: max error {err:.3g} against max |grad| {scale:.3g}")
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_patched_model_matches_pytorch_on_the_gpu(kind):
    la, ga, lb, gb, counts = _against_pytorch(kind, _ids(2, 256, "cuda"))
    want = ["attention", "embedding", "linear_cross_entropy"] + (
        ["layer_norm", "gelu"] if kind == "gpt2" else ["rms_norm", "rope", "swiglu"])
    for name in want:
        assert counts.get(name, {}).get("cukern", 0) > 0 and counts[name]["torch"] == 0, (name, counts)
    torch.testing.assert_close(lb, la, rtol=2e-3, atol=2e-3)
    _close_grads(ga, gb, 0.03)


@pytest.mark.gpu
def test_llama_rms_norm_gives_hugging_faces_bits():
    # bf16 model (no autocast): HF's RMSNorm rounds x̂ to bf16 before the weight; so does the kernel
    a = _model("llama", "cuda").to(torch.bfloat16)
    norm = a.model.layers[0].input_layernorm
    x = torch.randn((4, 64, 256), device="cuda", dtype=torch.bfloat16) * 3
    want = norm(x)
    with ct.patch(a, parts=("norm",), min_size=0):
        got = norm(x)
    assert got.dtype == want.dtype
    equal = (got == want).float().mean().item()
    assert equal > 0.99, f"{equal:.4f} of the outputs bitwise equal"
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3)


@pytest.mark.gpu
def test_a_half_precision_model_runs_rope_on_the_kernels():
    a = _model("llama", "cuda").to(torch.bfloat16)
    b = copy.deepcopy(a)
    ids = _ids(2, 256, "cuda")
    la = a(input_ids=ids, labels=ids).loss
    la.backward()
    ct.reset_counts()
    with ct.patch(b, min_size=0):
        lb = b(input_ids=ids, labels=ids).loss
        lb.backward()
        counts = ct.counts(reasons=True)
    assert counts["rope"] == {"cukern": 2, "torch": 0}, counts
    torch.testing.assert_close(lb.float(), la.float(), rtol=1e-2, atol=1e-2)
    _close_grads({n: p.grad.float() for n, p in a.named_parameters()},
                 {n: p.grad.float() for n, p in b.named_parameters()}, 0.08)


@pytest.mark.gpu
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_masks_run_as_varlen(side):
    ids = _ids(3, 192, "cuda")
    pad = torch.ones_like(ids)
    lengths = (192, 150, 77)
    for i, n in enumerate(lengths):
        if side == "right":
            pad[i, n:] = 0
        else:
            pad[i, :192 - n] = 0
    labels = ids.masked_fill(pad == 0, -100)
    if side == "left":   # (else the last padding position would predict the first token)
        for i, n in enumerate(lengths):
            labels[i, 192 - n] = -100
    la, ga, lb, gb, counts = _against_pytorch("llama", ids, labels, pad)
    assert counts["attention"]["cukern"] > 0 and counts["attention"]["torch"] == 0, counts
    torch.testing.assert_close(lb, la, rtol=2e-3, atol=2e-3)
    # (left padding: PyTorch's SDPA gives NaN gradients through the fully masked query rows of
    # the padding; the kernels give zeros there. Compared where PyTorch's are finite.)
    assert all(torch.isfinite(g).all() for g in gb.values())
    finite = {n: g for n, g in ga.items() if torch.isfinite(g).all()}
    assert side == "left" or len(finite) == len(ga)
    _close_grads(finite, gb, 0.03)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral"])
def test_packed_documents_run_as_varlen(kind):
    """Documents packed into rows (position ids that restart, no attention mask), as
    transformers' packing collators give: varlen on the kernels, no attention across
    documents (Mistral: with a window of 48 shorter than the longest document)."""
    rows = [[100, 37, 1, 54], [192], [5, 120, 67]]
    pos = _packed_positions(rows).to("cuda")
    ids = _ids(3, 192, "cuda")
    labels = ids.clone()
    labels[pos == 0] = -100   # (a document's first token is not predicted from the one before)
    over = {"sliding_window": 48} if kind == "mistral" else {}
    la, ga, lb, gb, counts = _against_pytorch(kind, ids, labels, position_ids=pos, **over)
    assert counts["attention"]["cukern"] > 0 and counts["attention"]["torch"] == 0, counts
    torch.testing.assert_close(lb, la, rtol=2e-3, atol=2e-3)
    _close_grads(ga, gb, 0.03)


@pytest.mark.gpu
def test_mistral_window_runs_on_the_kernels():
    la, ga, lb, gb, counts = _against_pytorch("mistral", _ids(2, 256, "cuda"), sliding_window=64)
    assert counts["attention"]["cukern"] > 0 and counts["attention"]["torch"] == 0, counts
    torch.testing.assert_close(lb, la, rtol=2e-3, atol=2e-3)
    _close_grads(ga, gb, 0.03)


@pytest.mark.gpu
def test_attention_dropout_trains_on_the_kernels_on_hopper():
    """GPT-2's default config trains with attention dropout 0.1: on Hopper those calls take the
    kernels (elsewhere they stay with PyTorch, counted with the reason); ``torch.manual_seed``
    repeats a step, and another seed drops other weights."""
    from cukern.attention.torch import dropout_route_reason

    m = _model("gpt2", "cuda", attn_pdrop=0.1, resid_pdrop=0.0, embd_pdrop=0.0)
    ids = _ids(2, 128, "cuda")
    losses = []
    for seed in (4, 4, 5):
        ct.reset_counts()
        m.zero_grad()
        torch.manual_seed(seed)
        with ct.patch(m, min_size=0):
            loss, grads = _train_step(m, ids, ids)
            counts = ct.counts(reasons=True)
        losses.append(loss)
        assert all(bool(torch.isfinite(g).all()) for g in grads.values())
    why = dropout_route_reason(ids.device, m.config.n_embd // m.config.n_head, m.config.n_embd // m.config.n_head)
    if why is None:
        assert counts["attention"]["cukern"] == 2 and counts["attention"]["torch"] == 0, counts
    else:
        assert counts["attention"]["cukern"] == 0 and counts["attention"]["torch_reasons"] == {why: 2}
    assert torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], losses[2])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_patched_model_compiles(kind):
    a = _model(kind, "cuda")
    b = copy.deepcopy(a)
    ids = _ids(2, 256, "cuda")
    la, ga = _train_step(a, ids, ids)
    with ct.patch(b, min_size=0):
        lb, _ = _train_step(torch.compile(b), ids, ids)
    gb = {n: p.grad.detach().float() for n, p in b.named_parameters()}
    torch.testing.assert_close(lb, la, rtol=3e-3, atol=3e-3)
    _close_grads(ga, gb, 0.05)


def test_the_demo_builds_each_hugging_face_model():
    from cukern.demo import hf, options

    for kind in KINDS:
        cfg = options.Config(layers=1, dim=128, heads=4, seq=64, vocab=0, model=kind)
        m = hf.build(cfg)
        assert m.config.vocab_size == hf.VOCAB[kind]
        assert m.config._attn_implementation == "sdpa"
        assert kind in hf.describe(cfg, m).lower() or "gpt2" in type(m).__name__.lower()
    with pytest.raises(ValueError, match="model"):
        hf.build(options.Config(model="vit"))   # (no causal-LM head)
    # (configs that transformers refuses to size so, whatever it raises: refused by name)
    for kind, raised in (("xlnet", "NotImplementedError"), ("musicgen", "ValueError"), ("emu3", "")):
        with pytest.raises(ValueError, match=rf"^model: transformers could not configure '{kind}' .*\({raised}"):
            hf.build(options.Config(layers=1, dim=64, heads=4, seq=32, vocab=97, model=kind))


def test_the_demo_keeps_the_attention_dropout_it_is_given():
    """--attn-dropout P: the attention weights' dropout of a transformers model under its own
    name in the config (GPT-2's attn_pdrop, LLaMA's and OPT's attention_dropout); every other
    dropout stays off; refused by name out of [0, 1) and for the demo's own GPT."""
    import argparse

    from cukern.demo import hf, options

    p = argparse.ArgumentParser()
    options.add_model_args(p)
    for kind, name in (("gpt2", "attn_pdrop"), ("llama", "attention_dropout"), ("opt", "attention_dropout")):
        cfg = options.config(p.parse_args(["--model", kind, "--attn-dropout", "0.1", "--layers", "1", "--dim", "128",
                                           "--heads", "4", "--seq", "64", "--vocab", "256"]))
        m = hf.build(cfg)
        assert getattr(m.config, name) == 0.1, kind
        assert getattr(m.config, "resid_pdrop", 0.0) == 0.0 and getattr(m.config, "dropout", 0.0) == 0.0
        assert hf.build(dataclasses.replace(cfg, attn_dropout=0.0)).config.to_dict()[name] == 0.0
    for bad in ("1.5", "-0.1", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--model", "gpt2", "--attn-dropout", bad])
    with pytest.raises(ValueError, match="^attn_dropout: must be in"):
        options.config(argparse.Namespace(**{**vars(p.parse_args(["--model", "gpt2"])), "attn_dropout": 1.0}))
    with pytest.raises(ValueError, match="^attn_dropout: only with a transformers --model"):
        options.config(p.parse_args(["--attn-dropout", "0.1"]))


def test_the_demo_takes_any_transformers_causal_lm_type():
    """--model names any model type with a causal-LM head (built from its config class at the
    demo's sizes, patched by what it computes); others are refused by name on the command line."""
    import argparse

    from cukern.demo import hf, options

    p = argparse.ArgumentParser()
    options.add_model_args(p)
    assert p.parse_args(["--model", "mixtral"]).model == "mixtral"
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "vit"])
    m = hf.build(options.Config(layers=1, dim=128, heads=4, seq=64, vocab=256, model="mixtral"))
    assert type(m).__name__ == "MixtralForCausalLM" and m.config.num_hidden_layers == 1
    assert m.config.hidden_size == 128 and m.config.vocab_size == 256
    # dropout off as in pretraining (OPT's config has 0.1), the sizes on a composite's text config
    opt = hf.build(options.Config(layers=1, dim=128, heads=4, seq=64, vocab=256, model="opt"))
    assert opt.config.dropout == 0.0 and opt.config.attention_dropout == 0.0
    llama4 = hf.build(options.Config(layers=1, dim=128, heads=4, seq=64, vocab=256, model="llama4"))
    assert llama4.config.get_text_config().hidden_size == 128
    assert sum(p.numel() for p in llama4.parameters()) < 2e7
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        expect = m(input_ids=ids, labels=ids).loss
    with ct.patch(m):
        got = ct.routing(m)
        assert got["(model)"] == "loss: linear cross-entropy on the LM head"
        assert got["model.layers.0.input_layernorm"].startswith("norm: RMSNorm")
        with torch.no_grad():
            torch.testing.assert_close(m(input_ids=ids, labels=ids).loss, expect, rtol=1e-5, atol=1e-5)


# ---- attention sinks (GPT-OSS's s_aux) ---------------------------------------------------------------

def _gpt_oss(device="cpu"):
    """A small GPT-OSS (4 experts, top 2; its windowed layer's window 16, shorter than the
    tests' sequences). Its routers' biases set every token's top 2 far apart from the rest: a
    choice of experts that a rounding could flip would make one token's gradients differ
    wholesale, whatever the attention computes."""
    import transformers

    c = transformers.GptOssConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, vocab_size=256, num_local_experts=4,
                                  num_experts_per_tok=2, sliding_window=16, max_position_embeddings=512)
    torch.manual_seed(0)
    m = transformers.GptOssForCausalLM(c).to(device)
    with torch.no_grad():
        for layer in m.model.layers:   # (the sinks start at zero; random ones are told apart)
            layer.self_attn.sinks.normal_(0.0, 2.0)
            layer.mlp.router.bias.copy_(torch.tensor([4.0, 2.0, -2.0, -4.0]))
    return m


def test_gpt_oss_sinks_are_never_dropped_on_the_cpu():
    """Calls the kernels do not take go to GPT-OSS's own eager code with its sinks (PyTorch's SDPA
    would drop them): the patched model's loss and gradients, sinks' included, are its own."""
    a = _gpt_oss()
    b = copy.deepcopy(a)
    ids = _ids(2, 24)
    a(input_ids=ids, labels=ids).loss.backward()
    ct.reset_counts()
    with ct.patch(b):
        assert ct.routing(b)["transformers.models.gpt_oss.modeling_gpt_oss.apply_rotary_pos_emb"] == \
            "rope: cukern's rope"
        b(input_ids=ids, labels=ids).loss.backward()
        assert ct.counts(reasons=True)["attention"]["torch"] == 2
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_gpt_oss_sinks_reach_the_sink_ops(monkeypatch):
    """On the kernels' path the sinks go to the sink ops as float32 (H,), one per query head;
    packed documents and windowed layers take the varlen sink op."""
    from cukern.torch import _models

    calls = []

    def route(T, q, k, v, dropout_p, is_causal, scale, enable_gqa):
        assert dropout_p == 0.0
        return "attention", (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal, scale), None

    def op(name):
        def run(*args):
            calls.append((name, args))
            q = args[0]
            return torch.zeros(q.shape, dtype=q.dtype), None
        return run

    monkeypatch.setattr(_attention, "_sdpa_route", lambda: route)
    for name in ("attention", "attention_sink", "attention_varlen", "attention_varlen_sink"):
        monkeypatch.setitem(_models.OPS, name, op(name))
    module = types.SimpleNamespace(is_causal=True)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    sinks = torch.randn(4, dtype=torch.bfloat16)
    _attention._hf_attention(module, q, k, v, None, scaling=0.5, s_aux=sinks)
    name, args = calls[-1]
    assert name == "attention_sink" and args[3].dtype == torch.float32 and torch.equal(args[3], sinks.float())
    _attention._hf_attention(module, q, k, v, None, scaling=0.5)
    assert calls[-1][0] == "attention"
    pad = torch.ones(2, 16, dtype=torch.bool)
    pad[0, :3] = False
    _attention._hf_attention(module, q, k, v, pad, scaling=0.5, s_aux=sinks)
    name, args = calls[-1]
    assert name == "attention_varlen_sink" and torch.equal(args[5], sinks.float())
    # sinks that are not one logit a query head: the model's own code, never the kernels without them
    n = len(calls)
    with pytest.raises(RuntimeError, match="sinks"):
        _attention._hf_attention(module, q, k, v, None, scaling=0.5, s_aux=torch.randn(3))
    assert len(calls) == n


@pytest.mark.gpu
def test_gpt_oss_trains_on_the_sink_kernels_like_its_own_on_the_gpu():
    a = _gpt_oss("cuda")
    b = copy.deepcopy(a)
    ids = _ids(2, 256, "cuda")
    la, ga = _train_step(a, ids, ids)
    ct.reset_counts()
    with ct.patch(b, min_size=0):
        lb, gb = _train_step(b, ids, ids)
        counts = ct.counts(reasons=True)
    assert counts["attention"]["cukern"] == 2 and counts["attention"]["torch"] == 0, counts
    assert counts["rope"] == {"cukern": 2, "torch": 0}, counts   # (its half-width tables)
    torch.testing.assert_close(lb, la, rtol=5e-3, atol=5e-3)
    _close_grads(ga, gb, 0.05)
