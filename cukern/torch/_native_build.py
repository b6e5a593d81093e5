"""Building ``cukern.torch``'s C++ extension (``_native.cpp``) once per machine, off the first
training step's path.

The build (``torch.utils.cpp_extension``: a host C++ compiler and ninja, about 30 s) goes into a
folder of cukern's cache (``cukern._cache``: ``torch-ext/<key>``) keyed by the source, the
PyTorch build and the Python version, so a second process finds it with one ``stat`` and loads
it directly (no ninja run). The folder holds, beside the build:

* ``ok``: the build is whole (written last, naming the library);
* ``failed``: why the build failed or could not run (no compiler, no ninja); it is not tried
  again until the key changes or ``python -m cukern warmup`` asks for it;
* ``build.lock``: held while a build runs, so processes starting at once build it once;
* ``build.log``: a background build's output.

``start()`` runs the build in a process of its own, which finishes even if the process that
started it ends first; ``ensure()`` builds in the foreground, or waits for a build another
process runs.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

# (absolute: the background build loads this file on its own, without cukern.torch: see _CHILD)
from cukern import _cache

NAME = "cukern_native"
SOURCE = Path(__file__).with_name("_native.cpp")
FLAGS = ("-O2",)

_loaded: dict[str, object] = {}   # folder -> the module imported in this process


class BuildFailed(RuntimeError):
    """The extension could not be built (the reason is kept in the folder's ``failed``)."""


def folder() -> Path:
    """This source's and this PyTorch's build folder."""
    import torch

    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    return _cache.directory() / "torch-ext" / _cache.key(
        SOURCE.read_bytes(), FLAGS, torch.__version__, torch.version.cuda, abi, sys.version_info[:2], sys.platform)


def state(where: Path | None = None) -> str:
    """"built", "failed", "building" (another process holds the build lock) or "absent"."""
    where = where or folder()
    if (where / "ok").is_file():
        return "built"
    if (where / "failed").is_file():
        return "failed"
    if _cache.held(where / "build.lock"):
        return "building"
    return "absent"


def failure(where: Path | None = None) -> str:
    """The recorded reason of a failed build ("" when none is recorded)."""
    try:
        return ((where or folder()) / "failed").read_text().strip()
    except OSError:
        return ""


def load(where: Path | None = None):
    """The built extension, imported (once a process) from its folder."""
    where = where or folder()
    mod = _loaded.get(str(where))
    if mod is None:
        library = where / (where / "ok").read_text().strip()
        spec = importlib.util.spec_from_file_location(NAME, library)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _loaded[str(where)] = mod
    return mod


def ensure(where: Path | None = None, retry: bool = False):
    """The extension: loaded if built, else built here (or, when another process is building it,
    waited for). A recorded failure raises BuildFailed without a new try unless ``retry``."""
    where = where or folder()
    if (where / "ok").is_file():
        return load(where)
    if retry:
        _unlink(where / "failed")
    with _cache.lock(where / "build.lock"):
        if (where / "ok").is_file():
            return load(where)
        if (where / "failed").is_file():
            raise BuildFailed(failure(where))
        return _build(where)


def _missing_tool() -> str | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (set CXX, or install g++)"
    try:
        from torch.utils.cpp_extension import is_ninja_available
    except ImportError:
        is_ninja_available = lambda: shutil.which("ninja") is not None   # noqa: E731
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _build(where: Path):
    """Build into ``where`` (the build lock held); record ``ok`` or ``failed``."""
    where.mkdir(parents=True, exist_ok=True)
    missing = _missing_tool()
    if missing is not None:
        _record_failure(where, missing)
        raise BuildFailed(missing)
    try:
        from torch.utils import cpp_extension

        mod = cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=list(FLAGS),
                                 build_directory=str(where), verbose=False)
    except Exception as e:  # noqa: BLE001 - a compiler error, an ABI it cannot build against
        reason = f"{type(e).__name__}: {' '.join(str(e).split())[:2000]}"
        _record_failure(where, reason)
        raise BuildFailed(reason) from None
    library = next((p.name for p in sorted(where.glob(NAME + ".*")) if p.suffix in (".so", ".pyd")), None)
    if library is None:
        reason = f"the build left no {NAME} library in {where}"
        _record_failure(where, reason)
        raise BuildFailed(reason)
    _loaded[str(where)] = mod
    _cache.write_atomic(where / "ok", library.encode())
    return mod


def _record_failure(where: Path, reason: str) -> None:
    try:
        _cache.write_atomic(where / "failed", reason.encode())
    except OSError:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def start(where: Path | None = None):
    """Start the build in a process of its own (the Popen), or None where there is nothing to
    start (built, failed, or another process building it). The build lock is taken here and
    handed to the child, so a process starting a moment later sees "building" at once."""
    where = where or folder()
    if state(where) != "absent":
        return None
    where.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        fcntl = None
    fd = os.open(where / "build.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return None   # (another process took it a moment ago)
        if (where / "ok").is_file() or (where / "failed").is_file():
            return None
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])   # (the child imports this cukern)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        with open(where / "build.log", "ab") as log:
            return subprocess.Popen([sys.executable, "-c", _CHILD, str(Path(__file__).resolve()), str(where),
                                     str(fd if fcntl else -1)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, pass_fds=(fd,))
    finally:
        os.close(fd)   # (the child's copy keeps the lock until it ends)


# The build's process loads this file by its path, not as cukern.torch._native_build: the
# package's __init__ imports torch, which a build that cannot run (no compiler) never needs and
# a build imports when it starts. (niced: the build must not take CPU time from the training
# step that started it)
_CHILD = ("import os, sys, importlib.util as u; os.nice(19); "
          "spec = u.spec_from_file_location('_cukern_native_build', sys.argv[1]); m = u.module_from_spec(spec); "
          "spec.loader.exec_module(m); sys.exit(m.main(sys.argv[2:]))")


def main(argv: list[str]) -> int:
    """The background build's process: builds into the folder ``argv[0]``, holding the build
    lock through the descriptor ``argv[1]`` its parent took it on (-1: none; it takes it)."""
    where, fd = Path(argv[0]), int(argv[1])
    try:
        if fd < 0:
            ensure(where)
        elif not ((where / "ok").is_file() or (where / "failed").is_file()):
            _build(where)
    except BuildFailed as e:
        print(f"cukern.torch: the extension's build failed: {e}", file=sys.stderr)
        return 1
    return 0
