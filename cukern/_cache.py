"""cukern's on-disk cache: where it is, keys, file locks and atomic writes.

The directory is ``$CUKERN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cukern`` (``~/.cache/cukern``).
It holds what cukern builds itself, once per machine, shared by every process that starts:

* ``cubin/``: the kernels NVRTC builds for one architecture's own features (sm_90a), which
  CuPy's kernel cache (``$CUPY_CACHE_DIR``) does not hold;
* ``torch-ext/``: ``cukern.torch``'s C++ extension, one folder per source and PyTorch build;
* ``locks/``: a lock a kernel, so ranks starting at once on an empty cache compile each kernel
  once (the others wait, then load what it wrote).

Writes are atomic (a temporary file renamed into place): a reader sees a whole file or none.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

__all__ = ["directory", "key", "lock", "write_atomic"]


def directory() -> Path:
    """The cache directory (not created here)."""
    explicit = os.environ.get("CUKERN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cukern"


def key(*parts) -> str:
    """A file name for what ``parts`` (their ``repr``) build: 40 hex digits of SHA-256."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


@contextlib.contextmanager
def lock(path: Path):
    """Hold an exclusive lock on ``path`` (created as needed) while the block runs; another
    process taking it waits. Where the file system cannot lock (or the folder cannot be made),
    the block runs unlocked: two processes then may build the same thing, which is safe, since
    every write is atomic."""
    try:
        import fcntl
    except ImportError:   # (no fcntl: not POSIX)
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)   # (closing releases the lock)


def held(path: Path) -> bool:
    """Whether another process holds the lock on ``path`` now."""
    try:
        import fcntl
        fd = os.open(path, os.O_RDWR)
    except (ImportError, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
