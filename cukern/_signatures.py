"""Kernel instances and their declared signatures: the parameter list of every ``__global__``
template is read from its CUDA source, so kernel arguments are packed against the declared C
types, by parameter name (``cukern._kernels`` packs and launches them). A parameter that is a
plain struct taken by value (the attention kernels' ``FwdParams<T>``, ...) is read from its
declaration too and packed field by field, by field name, at the struct's C layout.

An :class:`Instance` names what a family launches: the source, the template instance as an NVRTC
name expression (e.g. ``norm_fwd<cuk::bf16, false, 8, ...>``) and its dynamic shared memory."""
from __future__ import annotations

import functools
import re
import struct
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
    """One declared kernel parameter (or struct field): its name, its C base type, whether it is
    a pointer, and the type's template arguments (``FwdParams<T>``: ``("T",)``)."""
    name: str
    ctype: str
    pointer: bool
    targs: tuple[str, ...] = ()


@dataclass(frozen=True)
class StructDecl:
    """A plain C struct as the source declares it (data members only): what a kernel taking it
    by value is packed from, field by field."""
    name: str
    template: tuple[tuple[str, str], ...]
    fields: tuple[Param, ...]


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
    targs = ()
    if "<" in text:   # a template type: FwdParams<T> p
        targs = _split_args(text[text.index("<") + 1:text.rindex(">")])
        text = text[:text.index("<")] + " " + text[text.rindex(">") + 1:]
    pointer = "*" in text
    words = [w for w in re.findall(r"[\w:]+", text.replace("*", " ")) if w not in _QUALIFIERS]
    if len(words) < 2:
        raise ValueError(f"{where}: cannot read the kernel parameter {text!r}")
    return Param(words[-1], " ".join(words[:-1]), pointer, targs)


_STRUCT = re.compile(r"(?:template\s*<(?P<tpl>[^{};]*?)>\s*)?struct\s+(?P<name>\w+)\s*\{")


@functools.lru_cache(maxsize=None)
def _struct_bodies(source: str) -> dict[str, tuple[str, str]]:
    """Every ``struct Name { ... }`` of the expanded source: name -> (template text, body)."""
    text = _strip_comments(_sources.load_source(source))
    found = {}
    for m in _STRUCT.finditer(text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        found[m.group("name")] = (m.group("tpl") or "", text[m.end():i - 1])
    return found


def struct_declaration(source: str, name: str) -> StructDecl | None:
    """The struct ``name`` (namespace qualifiers ignored) as ``cuda_src/<source>`` declares it,
    or None where it declares none by that name. A struct with anything but data members (member
    functions, static members) cannot be a kernel's parameter here."""
    found = _struct_bodies(source).get(name.rsplit("::", 1)[-1])
    if found is None:
        return None
    tpl, body = found
    where = f"{source}: struct {name}"
    if any(c in body for c in "{}()=") or re.search(r"\b(static|using|typedef)\b", body):
        raise ValueError(f"{where} has more than data members; a kernel parameter struct holds fields only")
    fields = []
    for decl in (d.strip() for d in body.split(";")):
        if not decl:
            continue
        first, *more = _split_args(decl)
        head = _parse_param(first, where)
        fields.append(head)
        fields += [Param(m.replace("*", "").strip(), head.ctype, "*" in m, head.targs) for m in more]
    return StructDecl(name, tuple(tuple(p.rsplit(None, 1)) for p in _split_args(tpl)), tuple(fields))


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


# C alignment of each struct code (x86-64 and the device agree), and a code of each alignment.
_ALIGNMENT = {"q": 8, "Q": 8, "d": 8, "P": 8, "i": 4, "I": 4, "f": 4}
_CODE_OF_ALIGNMENT = {8: "Q", 4: "I"}


@dataclass(frozen=True)
class Signature:
    """The parameters of one instance with template types resolved, a struct taken by value
    flattened into its fields: for each field its name and either a struct code (scalars) or the
    dtype name its pointer takes (None: any). ``aligns`` gives, a field, the alignment a struct
    sets before it (its first field) and after it (its last: the struct's size is a multiple of
    its alignment), 0 for none; ``params`` the field each declared parameter begins at (empty:
    every field is a parameter)."""
    kernel: str
    names: tuple[str, ...]
    codes: tuple[str, ...]            # struct code a parameter; "P" for pointers
    dtypes: tuple[str | None, ...]    # pointers: the element dtype; scalars: None
    aligns: tuple[tuple[int, int], ...] = ()
    params: tuple[int, ...] = ()

    @functools.cached_property
    def _layout(self) -> tuple[str, tuple[int, ...]]:
        fmt, offsets = "@", []
        for code, (before, after) in zip(self.codes, self.aligns or ((0, 0),) * len(self.codes)):
            if before:
                fmt += "0" + _CODE_OF_ALIGNMENT[before]
            if code == TENSOR_MAP:   # 128 bytes, 64-byte aligned (struct alignas(64) CUtensorMap)
                at = struct.calcsize(fmt)
                pad = -at % 64
                fmt += f"{pad}x128s" if pad else "128s"
                offsets.append(at + pad)
            else:
                code = "Q" if code == "P" else code
                offsets.append(struct.calcsize(fmt + "0" + code))
                fmt += code
            if after:
                fmt += "0" + _CODE_OF_ALIGNMENT[after]
        return fmt, tuple(offsets)

    @property
    def format(self) -> str:
        """The struct-module format of the C parameter buffer (native alignment), a value a field."""
        return self._layout[0]

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each field's byte offset in the parameter buffer."""
        return self._layout[1]

    @property
    def param_offsets(self) -> tuple[int, ...]:
        """Each declared parameter's byte offset (cuLaunchKernel's kernelParams point there)."""
        return tuple(self.offsets[i] for i in (self.params or range(len(self.codes))))


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
    names, codes, dtypes, aligns, params = [], [], [], [], []

    def field(p: Param, types: dict) -> None:
        ctype = types.get(p.ctype, p.ctype)
        if p.pointer:
            if ctype not in elements:
                raise ValueError(f"{inst.name}: parameter {p.name} points to {ctype}, which has no dtype here")
            codes.append("P")
            dtypes.append(elements[ctype])
        elif ctype == "CUtensorMap":   # (by value, 128 bytes at a 64-byte offset: see Signature)
            codes.append(TENSOR_MAP)
            dtypes.append(None)
        elif (sd := struct_declaration(inst.source, ctype)) is not None:
            by_value(sd, tuple(types.get(a, a) for a in p.targs))
            return
        else:
            code = _SCALAR_CODES.get(ctype)
            if code is None:
                raise ValueError(f"{inst.name}: parameter {p.name} has C type {ctype}, which cannot be packed")
            codes.append(code)
            dtypes.append(None)
        names.append(p.name)
        aligns.append([0, 0])

    def by_value(sd: StructDecl, targs: tuple[str, ...]) -> None:
        if len(targs) != len(sd.template):
            raise ValueError(f"{inst.name}: struct {sd.name} takes {len(sd.template)} template arguments; "
                             f"given {len(targs)}")
        inner = {name: arg for (kind, name), arg in zip(sd.template, targs) if kind in ("typename", "class")}
        first = len(codes)
        for f in sd.fields:
            field(f, inner)
        if TENSOR_MAP in codes[first:] or first == len(codes):
            raise ValueError(f"{inst.name}: struct {sd.name} must hold scalars and pointers (no tensor maps), "
                             "at least one")
        align = max(_ALIGNMENT[c] for c in codes[first:])
        aligns[first][0] = max(aligns[first][0], align)
        aligns[-1][1] = max(aligns[-1][1], align)

    for p in decl.params:
        params.append(len(codes))
        field(p, types)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{inst.name}: the fields {repeated} appear twice among the parameters and their structs' "
                         "fields (arguments are given by field name)")
    plain = len(params) == len(codes)
    return Signature(inst.kernel_name, tuple(names), tuple(codes), tuple(dtypes),
                     () if plain else tuple(tuple(a) for a in aligns), () if plain else tuple(params))
