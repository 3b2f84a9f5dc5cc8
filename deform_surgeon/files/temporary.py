"""Temporary files beside their target, and the lock of a folder: what the writer (write.py, pair.py) and every
command that writes a file (`atomic_path`) write through.

A temporary's name starts with its target's (`temp_prefix`), so the temporaries of one target are found by it, and
is chosen before the file is made, so no way out leaves one behind. A temporary is proven a dead writer's by its
lock: each writer holds an advisory lock on its own temporaries while they exist, which the system lets go when the
process ends, however it ends; one whose lock can be taken has no writer left (`dead_temporary`). The writers of
one folder take turns through the folder's own lock (`folder_lock`, an advisory lock on the folder itself, so
nothing is left behind) for what they do there in a few renames.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # (not POSIX: no advisory locks, the writers of one OUT do not take turns)
    fcntl = None  # type: ignore[assignment]

def temp_prefix(target: str | Path) -> str:
    """The start of every temporary name `atomic_path` makes for `target`: short whatever the target's length (a
    name of up to 255 bytes must still work), and the same for one target only (`settle_out` finds a killed
    writer's temporaries by it)."""
    name = Path(target).name
    readable = "".join(c if c.isascii() and c.isprintable() else "_" for c in name[:24])  # ORT takes UTF-8 only
    return f".{readable}.{hashlib.sha1(name.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}."


@contextmanager
def temp_path(target: str | Path, suffix: str = ".onnx") -> Iterator[Path]:
    """Yield a new, empty temporary file in the target's folder; it is removed on every way out unless it was
    renamed away, a signal included (the CLI turns SIGTERM into an exception, like Ctrl-C): its name is chosen
    *before* the file is created (O_EXCL), so there is no moment at which the file exists and the `finally` does
    not know its name. While it exists this process holds its lock (module docstring): it is created and locked
    holding the folder's lock, so no writer settling the folder ever finds it unlocked while this one lives."""
    target = Path(target)
    tmp_path: Path | None = None
    fd = None
    try:
        with folder_lock(target.parent):
            for _ in range(100):
                tmp_path = target.parent / f"{temp_prefix(target)}{secrets.token_hex(4)}.tmp{suffix}"
                try:  # mode 0666 minus the umask: the mode any new file gets
                    fd = os.open(tmp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                    break
                except FileExistsError:
                    tmp_path = None
            else:
                raise FileExistsError(errno.EEXIST, "no free temporary name", str(target.parent))
            _hold(fd)
        yield tmp_path
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()
        if fd is not None:
            _LOCK_FDS.discard(fd)
            os.close(fd)


@contextmanager
def atomic_path(target: str | Path, suffix: str = ".onnx") -> Iterator[Path]:
    """Yield a temporary path in the target's folder (`temp_path`); rename it over `target` only if the block
    succeeds (a rename within one folder is atomic)."""
    with temp_path(target, suffix) as tmp:
        yield tmp
        os.replace(tmp, target)


def dead_temporary(path: Path) -> int | None:
    """A descriptor holding the lock of the temporary `path` when its writer is gone (the lock could be taken);
    None while a writer holds it, or where that cannot be told (not a regular file, a file system without locks)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
    except OSError:  # (BlockingIOError: its writer lives)
        pass
    os.close(fd)
    return None


def free_name(target: Path, suffix: str) -> Path:
    """A name beside `target` that no file has, of `temp_prefix(target)`'s form (short whatever the target's)."""
    for _ in range(100):
        path = target.parent / f"{temp_prefix(target)}{secrets.token_hex(4)}{suffix}"
        if not os.path.lexists(path):
            return path
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(target.parent))


_HELD = threading.local()  # `folders`: the (device, inode) of each folder whose lock this thread holds
_LOCK_FDS: set[int] = set()  # this process's descriptors that hold a lock


@contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold the lock of `folder` while the block runs: an advisory `flock` on the folder itself (a lock file beside
    OUT would be one more file left behind, and one removed could be locked by two writers at once). The writers
    of a folder's files take turns through it for what they do there in a few renames (judge a data file, put a
    pair in place); a second one waits (`_wait`). Taken once per thread (a block may call what takes it again).
    Where the folder cannot be opened or the file system has no locks, the block runs without it."""
    try:
        st = os.stat(folder)
    except OSError:
        st = None
    mine = _HELD.__dict__.setdefault("folders", set())
    key = None if st is None else (st.st_dev, st.st_ino)
    fd = _lock_folder(folder) if key is not None and key not in mine else None
    if fd is None:
        yield
        return
    mine.add(key)
    try:
        yield
    finally:
        mine.discard(key)
        _LOCK_FDS.discard(fd)
        os.close(fd)  # (the lock goes with the last descriptor of it)


def _lock_folder(folder: Path) -> int | None:
    """A descriptor of `folder` holding its lock; None where it cannot be had (`folder_lock`)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # (a folder that may be written but not read)
        return None
    _LOCK_FDS.add(fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait(fd)
    except BaseException as exc:  # a file system without locks; or Ctrl-C while waiting
        _LOCK_FDS.discard(fd)
        os.close(fd)
        if isinstance(exc, OSError):
            return None
        raise
    return fd


def _hold(fd: int) -> None:
    """Lock this process's new temporary `fd` (no one else has it: it was made holding the folder's lock)."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # (a file system without locks: the temporary cannot be proven a dead writer's either)
            return
        _LOCK_FDS.add(fd)


def _wait(fd: int) -> None:
    """Wait for the lock another writer holds (its few renames; a signal still stops the wait)."""
    fcntl.flock(fd, fcntl.LOCK_EX)


def _forget_locks() -> None:
    """In a forked child (background.py's checks, verify's runs of each model): close the parent's descriptors that
    hold locks, which the child never uses. Were the parent killed, a child still running would otherwise hold its
    locks until it ends, and another writer would wait for it."""
    for fd in list(_LOCK_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()
    _HELD.__dict__.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks)
