"""Kernel instances and their declared signatures: the parameter list of every ``__global__``
template is read from its CUDA source, so kernel arguments are packed against the declared C
types, by parameter name (``cukern._kernels`` packs and launches them).

An :class:`Instance` names what a family launches: the source, the template instance as an NVRTC
name expression (e.g. ``norm_fwd<cuk::bf16, false, 8, ...>``) and its dynamic shared memory."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from . import _sources

# ---- instances and their declared signatures -------------------------------------------------

@dataclass(frozen=True)
class Instance:
    """One template instance of a kernel: what NVRTC compiles and what a launch needs to know.

    ``name`` is the NVRTC name expression; ``smem`` the dynamic shared memory in bytes (the
    kernels that use it check this number against their own with a static_assert, so the
    compile check catches a mismatch); ``threads`` the block size the kernel is built for;
    ``arch`` an architecture with its own features the instance is built for alone ("sm_90a":
    wgmma, setmaxnreg), else None (built by CuPy for the device it runs on); ``cluster`` the
    CTAs of the cluster the kernel declares (``__cluster_dims__``), 0 for none: above 8, the
    portable limit, the kernel is allowed the larger size when it is loaded."""
    source: str
    name: str
    threads: int
    smem: int = 0
    arch: str | None = None
    cluster: int = 0

    @property
    def kernel_name(self) -> str:
        return self.name.split("<", 1)[0].strip()

    @property
    def template_args(self) -> tuple[str, ...]:
        return _split_args(self.name[self.name.index("<") + 1:self.name.rindex(">")]) if "<" in self.name else ()


@dataclass(frozen=True)
class Param:
    """One declared kernel parameter: its name, its C base type and whether it is a pointer."""
    name: str
    ctype: str
    pointer: bool


@dataclass(frozen=True)
class Declaration:
    """A ``__global__`` function as the source declares it: template parameters and parameters."""
    name: str
    template: tuple[tuple[str, str], ...]   # (kind, name): ("typename", "T"), ("int", "VEC"), ...
    params: tuple[Param, ...]


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _split_args(text: str) -> tuple[str, ...]:
    """Top-level comma split (template arguments may hold nested <...> or (...))."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return tuple(out)


_GLOBAL = re.compile(r"(?:template\s*<(?P<tpl>[^{};]*?)>\s*)?__global__\s+void\s+"
                     r"(?:(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)|CUK_[A-Z0-9_]+)\s*)*(?P<name>\w+)\s*\((?P<params>[^)]*)\)")
_QUALIFIERS = {"const", "volatile", "__restrict__", "__grid_constant__"}


def _parse_param(text: str, where: str) -> Param:
    pointer = "*" in text
    words = [w for w in re.findall(r"[\w:]+", text.replace("*", " ")) if w not in _QUALIFIERS]
    if len(words) < 2:
        raise ValueError(f"{where}: cannot read the kernel parameter {text!r}")
    return Param(words[-1], " ".join(words[:-1]), pointer)


@functools.lru_cache(maxsize=None)
def declarations(source: str) -> dict[str, Declaration]:
    """Every ``__global__`` function of ``cuda_src/<source>`` by name, read from its text."""
    found = {}
    for m in _GLOBAL.finditer(_strip_comments(_sources.load_source(source))):
        tpl = tuple(tuple(p.rsplit(None, 1)) for p in _split_args(m.group("tpl") or ""))
        params = tuple(_parse_param(p, f"{source}: {m.group('name')}") for p in _split_args(m.group("params")))
        found[m.group("name")] = Declaration(m.group("name"), tpl, params)
    return found


# The code of a CUtensorMap parameter (a TMA descriptor passed by value, __grid_constant__).
TENSOR_MAP = "M"

# C scalar types -> struct codes (native size and alignment: the C parameter-buffer layout).
_SCALAR_CODES = {"long long": "q", "int": "i", "float": "f", "unsigned long long": "Q", "unsigned int": "I",
                 "double": "d"}
# Element types of pointers -> dtype names of the arrays that may be passed.
_STANDARD_ELEMENTS = {"float": "float32", "double": "float64", "long long": "int64", "int": "int32",
                      "unsigned char": "uint8", "unsigned long long": "uint64", "unsigned int": "uint32",
                      "char": "int8", "void": None}


def _element_dtypes() -> dict[str, str | None]:
    from ._arrays import DTYPES, FP8

    table = dict(_STANDARD_ELEMENTS)
    table.update({ctype: name for name, (ctype, _) in (*DTYPES.items(), *FP8.items())})
    return table


@dataclass(frozen=True)
class Signature:
    """The parameters of one instance with template types resolved: for each, its name and
    either a struct code (scalars) or the dtype name its pointer takes (None: any)."""
    kernel: str
    names: tuple[str, ...]
    codes: tuple[str, ...]            # struct code a parameter; "P" for pointers
    dtypes: tuple[str | None, ...]    # pointers: the element dtype; scalars: None


@functools.lru_cache(maxsize=None)
def signature(inst: Instance) -> Signature:
    """The declared parameter list of ``inst``, template types resolved from its arguments."""
    decl = declarations(inst.source).get(inst.kernel_name)
    if decl is None:
        raise ValueError(f"{inst.source} declares no __global__ function {inst.kernel_name!r}")
    targs = inst.template_args
    if len(targs) != len(decl.template):
        raise ValueError(f"{inst.name}: {len(targs)} template arguments, but {inst.kernel_name} declares "
                         f"{len(decl.template)} ({', '.join(' '.join(t) for t in decl.template)})")
    types = {name: arg for (kind, name), arg in zip(decl.template, targs) if kind in ("typename", "class")}
    elements = _element_dtypes()
    codes, dtypes = [], []
    for p in decl.params:
        ctype = types.get(p.ctype, p.ctype)
        if p.pointer:
            if ctype not in elements:
                raise ValueError(f"{inst.name}: parameter {p.name} points to {ctype}, which has no dtype here")
            codes.append("P")
            dtypes.append(elements[ctype])
        elif ctype == "CUtensorMap":   # (by value, 128 bytes at a 64-byte offset: see pack)
            codes.append(TENSOR_MAP)
            dtypes.append(None)
        else:
            code = _SCALAR_CODES.get(ctype)
            if code is None:
                raise ValueError(f"{inst.name}: parameter {p.name} has C type {ctype}, which cannot be packed")
            codes.append(code)
            dtypes.append(None)
    return Signature(inst.kernel_name, tuple(p.name for p in decl.params), tuple(codes), tuple(dtypes))
