"""The docs against the code, with no GPU: the functions ``patch()`` replaces and the custom ops
that docs/torch.md, the README and the docstrings list are the families' declarations, and
docs/attention.md's signatures are the attention functions' own."""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from cukern import _registry

REPO = Path(__file__).resolve().parents[1]
NO_DEFAULT = object()


# ---- reading the docs ----------------------------------------------------------------------------

def _section(text: str, heading: str, where: str) -> list[str]:
    """The lines after the heading line ``heading`` up to the next heading of its level or above."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == heading]
    assert len(starts) == 1, f"{where}: expected one heading {heading!r}, found {len(starts)}"
    level = len(heading) - len(heading.lstrip("#"))
    out = []
    for line in lines[starts[0] + 1:]:
        m = re.match(r"(#+) ", line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return out


def _first_column(lines: list[str], where: str) -> list[str]:
    """The backticked names in the first column of the first table among ``lines``."""
    rows = []
    for line in lines:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    assert len(rows) > 2, f"{where}: no table"
    names = []
    for row in rows[2:]:   # (past the header and its separator)
        names += re.findall(r"`([A-Za-z_]\w*)`", row.split("|")[1])
    return names


def _code_blocks(lines: list[str]) -> tuple[list[str], str]:
    """(the ```python blocks among ``lines``, the text outside every fenced block)."""
    blocks, prose, fence, block = [], [], None, []
    for line in lines:
        if line.startswith("```"):
            if fence is None:
                fence, block = line.strip(), []
            else:
                if fence == "```python":
                    blocks.append("\n".join(block))
                fence = None
        elif fence is not None:
            block.append(line)
        else:
            prose.append(line)
    return blocks, "\n".join(prose)


def _compare(documented, actual, what: str) -> None:
    documented, actual = list(documented), set(actual)
    twice = sorted({n for n in documented if documented.count(n) > 1})
    missing, extra = sorted(actual - set(documented)), sorted(set(documented) - actual)
    assert not (missing or extra or twice), f"{what}: missing {missing}, extra {extra}, listed twice {twice}"


# ---- patch()'s functions and the custom ops --------------------------------------------------------

def _dropins() -> set[str]:
    return {d.replaces for f in _registry.families() for d in f.dropins}


def _torch_ops() -> set[str]:
    return {op.name for f in _registry.families() for op in f.torch_ops}


TORCH_MD = REPO / "docs" / "torch.md"


def test_torch_md_lists_the_functions_patch_replaces():
    lines = _section(TORCH_MD.read_text(), "### The functions `patch()` replaces", "docs/torch.md")
    _compare(_first_column(lines, "docs/torch.md, The functions `patch()` replaces"), _dropins(),
             "docs/torch.md's table of the functions patch() replaces, against the families' DropIns")


def test_torch_md_lists_the_custom_ops():
    lines = _section(TORCH_MD.read_text(), "### The custom ops", "docs/torch.md")
    _compare(_first_column(lines, "docs/torch.md, The custom ops"), _torch_ops(),
             "docs/torch.md's table of custom ops, against the families' TorchOps")


def _f_names(text: str) -> list[str]:
    return re.findall(r"\bF\.(\w+)", text)


def test_docstrings_and_readme_list_the_functions_patch_replaces():
    """cukern.torch._patch's and cukern.torch's docstrings and the README's patch() example
    name every function patch() replaces (as ``F.name``), and no other."""
    patch_doc = ast.get_docstring(ast.parse((REPO / "cukern" / "torch" / "_patch.py").read_text()))
    _compare(_f_names(patch_doc), _dropins(), "cukern/torch/_patch.py's docstring")
    init_doc = ast.get_docstring(ast.parse((REPO / "cukern" / "torch" / "__init__.py").read_text()))
    _compare(_f_names(init_doc), _dropins(), "cukern/torch/__init__.py's docstring")
    readme, _ = _code_blocks((REPO / "README.md").read_text().splitlines())
    blocks = [b for b in readme if "cukern.torch.patch()" in b]
    assert len(blocks) == 1, f"README.md: expected one code block with cukern.torch.patch(), found {len(blocks)}"
    _compare(_f_names(blocks[0]), _dropins(), "README.md's patch() example")


def test_the_registry_is_what_cukern_torch_builds():
    """The names the tests above compare with are what cukern.torch installs and registers:
    patch()'s drop-ins, and ``torch.ops.cukern.<name>`` with ``<name>_backward`` for each op."""
    torch = pytest.importorskip("torch")
    import cukern.torch
    from cukern.torch._functional import DROPIN_SPECS
    from cukern.torch._ops import OPS

    assert set(cukern.torch.OPS) == set(DROPIN_SPECS) == _dropins()
    assert set(OPS) == _torch_ops()
    for name in sorted(_torch_ops()):
        for op in (name, f"{name}_backward"):
            assert hasattr(torch.ops.cukern, op), f"torch.ops.cukern.{op} is not registered"


# ---- attention's signatures --------------------------------------------------------------------

ATTENTION_MD = REPO / "docs" / "attention.md"


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur] if p.strip()]


def _documented_signatures() -> tuple[dict[str, list[str]], str]:
    """({"cukern.attention": ["q", "k", "v", "*", "causal=False", ...], ...} from the ```python
    blocks of docs/attention.md's API section, the section's prose)."""
    blocks, prose = _code_blocks(_section(ATTENTION_MD.read_text(), "## API", "docs/attention.md"))
    sigs: dict[str, list[str]] = {}
    for block in blocks:
        for m in re.finditer(r"\b(cukern(?:\.torch)?\.\w+)\(", block):
            depth, i = 1, m.end()
            while depth:
                assert i < len(block), f"docs/attention.md: {m.group(1)}( is not closed"
                depth += {"(": 1, ")": -1}.get(block[i], 0)
                i += 1
            assert m.group(1) not in sigs, f"docs/attention.md: {m.group(1)} has two signatures in the API section"
            sigs[m.group(1)] = _split_top(block[m.end():i - 1])
    return sigs, prose


def _public_attention_functions() -> dict[str, object]:
    attention = next(f for f in _registry.families() if f.name == "attention")
    fns = {f"cukern.{fn.__name__}": fn for fn in attention.api}
    try:
        import torch  # noqa: F401
    except ImportError:
        return fns
    from cukern.torch import _ops, _tools

    fns.update({f"cukern.torch.{name}": fn for name, fn in attention.torch_api(_tools, _ops.OPS, {}).items()})
    return fns


def _mismatches(doc: list[str], fn) -> list[str]:
    """What differs between a documented parameter list and ``fn``'s signature."""
    expect, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            expect.append(("*", NO_DEFAULT))
            star = True
        expect.append((p.name, NO_DEFAULT if p.default is p.empty else p.default))
    got = []
    for token in doc:
        name, eq, default = token.partition("=")
        got.append((name.strip(), ast.literal_eval(default.strip()) if eq else NO_DEFAULT))
    names, doc_names = [n for n, _ in expect], [n for n, _ in got]
    problems = []
    missing, extra = [n for n in names if n not in doc_names], [n for n in doc_names if n not in names]
    if missing or extra:
        problems.append(f"missing {missing}, extra {extra} (documented: {', '.join(doc)})")
    elif names != doc_names:
        problems.append(f"order: documented {doc_names}, code {names}")
    for (name, value), (_, doc_value) in zip(expect, [g for n in names for g in got if g[0] == n]):
        same = (value is NO_DEFAULT) == (doc_value is NO_DEFAULT) and (
            value is NO_DEFAULT or (type(value) is type(doc_value) and value == doc_value))
        if not same:
            show = ["no default" if v is NO_DEFAULT else repr(v) for v in (doc_value, value)]
            problems.append(f"{name}: documented {show[0]}, code {show[1]}")
    return problems


def test_attention_md_documents_every_argument_of_every_attention_function():
    """Each public attention function (cukern's array functions, cukern.torch's flash-attn
    functions where torch is installed) has one signature in docs/attention.md's API section
    with its parameters, in order, with its defaults; and each parameter is named (backticked)
    in the section's text, where its meaning is."""
    sigs, prose = _documented_signatures()
    fns = _public_attention_functions()
    torch_checked = any(n.startswith("cukern.torch.") for n in fns)
    unknown = sorted(n for n in sigs if n not in fns and (torch_checked or not n.startswith("cukern.torch.")))
    assert not unknown, f"docs/attention.md documents functions that do not exist: {unknown}"
    problems = []
    for name, fn in sorted(fns.items()):
        if name not in sigs:
            problems.append(f"{name}: no signature in the API section")
            continue
        problems += [f"{name}: {p}" for p in _mismatches(sigs[name], fn)]
        for p in inspect.signature(fn).parameters:
            if not re.search(rf"`{p}(=[^`]*)?`", prose):
                problems.append(f"{name}: `{p}` is not described in the API section's text")
    assert not problems, "docs/attention.md's API section:\n" + "\n".join(problems)


def test_the_attention_signature_check_sees_an_argument_left_out():
    """The check above fails, naming the argument, when a documented signature lacks one."""
    fn = next(f for f in _registry.families() if f.name == "attention").api[0]
    doc = [str(p) for p in inspect.signature(fn).parameters.values() if p.name != "softcap"]
    doc.insert(3, "*")
    assert any("missing ['softcap']" in p for p in _mismatches(doc, fn))
