"""Compare the PTX of kernel instances between a git revision and the working tree (no GPU).

Each instance is compiled by NVRTC to PTX (no ptxas) from the revision's ``cuda_src/`` and from
the working tree's, for the architecture it is built for (sm_90a kernels for compute_90a, the
others for compute_80 and compute_90), and the two texts compared after NVRTC's per-compile
hash of internal-linkage names (``_cu_<8 hex>_``, different on every compile) is masked. A
change of structure (headers split, specializations generated) must leave every instance's PTX
as it was.

    python tools/ptx_compare.py HEAD~1                       # every instance of every module
    python tools/ptx_compare.py f348b6a --source attention_fwd_sm90.cu --every 4
"""
from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cukern import _nvrtc, _registry, _sources  # noqa: E402

_HASH = re.compile(r"_cu_[0-9a-f]{8}_")


def ptx(text: str, name: str, instance: str, arch: str) -> str:
    lib = _nvrtc.library()
    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), 0, None, None)
    try:
        lib.nvrtcAddNameExpression(prog, instance.encode())
        opts = [*_sources.COMPILE_OPTIONS, "-ftz=true", f"-arch={arch}"]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
        size = ctypes.c_size_t()
        if status != 0:
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"{instance} for {arch}: {log.value.decode(errors='replace')[-2000:]}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, out)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return _HASH.sub("_cu_HASH_", out.value.decode())


def expanded(source: str, root: Path) -> str:
    """``source`` with its includes expanded from the ``cuda_src`` folder ``root``."""
    original = _sources.source_dir
    _sources.source_dir = lambda: root
    _sources.load_source.cache_clear()
    try:
        return _sources.load_source(source)
    finally:
        _sources.source_dir = original
        _sources.load_source.cache_clear()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revision", help="the git revision to compare with")
    ap.add_argument("--source", action="append", help="only this .cu file (repeatable; default: all)")
    ap.add_argument("--every", type=int, default=1, help="every Nth instance of a source (default: all)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.revision, "cuda_src"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        old_root, new_root = Path(tmp) / "cuda_src", _sources.source_dir()
        by_source: dict = {}
        for _, instances in _registry.kernel_modules():
            for inst in instances():
                by_source.setdefault(inst.source, []).append(inst)
        total = changed = 0
        for source, insts in sorted(by_source.items()):
            if args.source and source not in args.source:
                continue
            old, new = expanded(source, old_root), expanded(source, new_root)
            for inst in insts[::args.every]:
                for arch in ([inst.arch.replace("sm_", "compute_")] if inst.arch else ["compute_80", "compute_90"]):
                    total += 1
                    if ptx(old, source, inst.name, arch) != ptx(new, source, inst.name, arch):
                        changed += 1
                        print(f"changed: {source} {inst.name} ({arch})", flush=True)
            print(f"{source}: {len(insts[::args.every])} instances compared", flush=True)
    print(f"{total - changed} of {total} identical PTX, {changed} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
