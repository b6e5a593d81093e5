"""The CUDA sources: where they are, their text with local includes expanded, the options NVRTC
compiles them with, and the error it raises. Below both ``_kernels`` (which compiles through
CuPy) and ``_nvrtc`` (which drives NVRTC directly): neither imports the other for these."""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

__all__ = ["CompileError", "COMPILE_OPTIONS", "source_dir", "load_source"]

# -std=c++17 for `if constexpr`. -default-device: NVRTC 13.0 takes a generic lambda in device
# code (cross_entropy's with_options) for a host function unless unannotated functions default
# to __device__ (13.5 infers it); every function here is device code. CUKERN_EXTRA_NVRTC_OPTIONS
# (space-separated) adds options for experiments, e.g. -DCUK_STREAM_HINTS; they are part of
# CuPy's cache key.
COMPILE_OPTIONS = ("--std=c++17", "-default-device", *os.environ.get("CUKERN_EXTRA_NVRTC_OPTIONS", "").split())

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


class CompileError(RuntimeError):
    """NVRTC rejected a kernel instance. ``log`` holds NVRTC's log, ``instance`` the name."""

    def __init__(self, instance: str, log: str):
        self.instance = instance
        self.log = log
        super().__init__(f"NVRTC failed to compile {instance}:\n{log}")

    def __reduce__(self):   # (pickled whole, e.g. from a worker process of the compile check)
        return CompileError, (self.instance, self.log)


def source_dir() -> Path:
    """The ``cuda_src`` directory: inside the installed package, else in the source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "common").is_dir():
            return candidate
    raise FileNotFoundError(
        f"cukern's CUDA sources (cuda_src/) were found neither in {here} nor beside it; "
        "the installation is incomplete")


@functools.lru_cache(maxsize=None)
def load_source(name: str) -> str:
    """Text of ``cuda_src/<name>`` with its local includes expanded (each header once)."""
    root = source_dir()
    seen: set[Path] = set()

    def expand(path: Path) -> str:
        path = path.resolve()
        if path in seen:  # every header is `#pragma once`
            return ""
        seen.add(path)
        text = path.read_text()

        def include(m: re.Match) -> str:
            target = path.parent / m.group(1)
            if not target.is_file():
                raise FileNotFoundError(f"{path.name}: included file {m.group(1)} not found")
            return f"// ---- {m.group(1)}\n{expand(target)}\n// ---- end {m.group(1)}"

        return _INCLUDE.sub(include, text).replace("#pragma once", "")

    return expand(root / name)
