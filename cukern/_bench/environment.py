"""What the bench needs and finds: the GPU, torch, CuPy; versions (and Liger's)."""
from __future__ import annotations

from .._version import __version__

# ---- the environment -------------------------------------------------------------------------

def unavailable_reason() -> str | None:
    """None when a CUDA GPU, a CUDA build of torch and CuPy are all there; else what is missing."""
    problems = []
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken installation
        torch = None
        problems.append(f"PyTorch is not installed ({type(e).__name__}: {e}); the benchmark "
                        "compares against torch and times with torch.cuda events")
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        from .._environment import INSTALL_HINT

        cupy = None
        problems.append(f"CuPy is not installed ({type(e).__name__}: {e}); cukern launches its kernels "
                        f"through it: {INSTALL_HINT}, which brings CuPy with [ctk] (NVRTC and the CUDA headers)")
    gpu = None
    if cupy is not None:
        try:
            n = cupy.cuda.runtime.getDeviceCount()
            gpu = None if n > 0 else "the CUDA runtime reports 0 devices"
        except Exception as e:  # noqa: BLE001 - no driver, no device: the same answer
            gpu = f"{type(e).__name__}: {e}"
    if torch is not None:
        if torch.version.cuda is None:
            problems.append(f"PyTorch {torch.__version__} is a build without CUDA "
                            "(torch.version.cuda is None); install a CUDA build")
        elif gpu is None and not torch.cuda.is_available():
            gpu = "torch.cuda.is_available() is False"
    if gpu is not None:
        problems.insert(0, f"no CUDA GPU found ({gpu})")
    return "; ".join(problems) if problems else None


def device_info(device: int = 0) -> dict:
    import torch

    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "memory_bytes": p.total_memory, "l2_bytes": p.L2_cache_size}


def versions() -> dict:
    import cupy
    import torch

    from .. import _nvrtc

    try:
        nvrtc = "%d.%d" % _nvrtc.version()
    except Exception as e:  # noqa: BLE001
        nvrtc = f"unavailable ({e})"
    return {"cukern": __version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cupy": cupy.__version__, "nvrtc": nvrtc}

def _library_version(module: str, distribution: str) -> str | None:
    """``distribution``'s version where ``module`` imports, else None (absent or broken: no
    column for it)."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - absent or broken: no column
        return None
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def liger_version() -> str | None:
    """Liger-Kernel's version when it is installed (and importable), else None."""
    return _library_version("liger_kernel", "liger-kernel")


def quack_version() -> str | None:
    """quack's version (quack-kernels, CuTe DSL kernels) when it imports, else None."""
    return _library_version("quack", "quack-kernels")


def fa4_version() -> str | None:
    """FlashAttention-4's version (flash-attn-4, ``flash_attn.cute``) when it imports, else None."""
    return _library_version("flash_attn.cute", "flash-attn-4")
