"""Writing cache entries so that no reader ever sees half of one, and checking them when read.

Every file contbatch keeps in its cache (`paths.cache_dir()`) goes through here:

- `write_atomic` writes a file under a temporary name unique to the process and thread, syncs
  it and renames it over the old one: a reader sees the old file or the new one, never a
  prefix, and a writer stopped halfway (killed, a full disk) leaves at most a temporary file;
- `locked` serialises the writers of one entry across processes with `fcntl.flock`. The
  kernel drops the lock when its holder dies, however it dies, so a killed writer never
  blocks the next one; the lock file itself means nothing and is never deleted (deleting it
  would let a second writer lock a new file while the first still holds the old one);
- `write_manifest` records what was written (sizes and sha256 digests), last, and
  `check_manifest` compares an entry with that record before it is used: truncated, missing,
  foreign or stale files are found before a loader trips on them (a truncated shared library
  kills its loader with SIGBUS, which no `except` catches);
- `commit_folder` swaps a finished folder in with renames, and `remove_temps` clears what
  writers stopped halfway left behind; callers hold the entry's lock for both, so no live
  writer's files are touched.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("contbatch")

MANIFEST = "contbatch_manifest.json"
_TEMP = ".tmp-"  # between an entry's name and its writer's process id
_CHUNK = 1 << 20


def temp_path(path: Path) -> Path:
    """A sibling of `path` no other process or thread writes: `<name>.tmp-<pid>-<thread>-<random>`.
    A sibling, so the final rename stays within one file system (and so is atomic)."""
    token = f"{os.getpid()}-{threading.get_ident() & 0xFFFF:04x}-{secrets.token_hex(4)}"
    return path.with_name(f"{path.name}{_TEMP}{token}")


def fsync_dir(path: Path) -> None:
    """Persists a folder's entries (a rename is a change of the folder, not of the file).
    Some file systems cannot sync a folder; that only weakens durability, never atomicity."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replaces `path` with `data` whole, or leaves it as it was and raises (OSError: a full or
    read-only disk). The temporary file is removed on every failure."""
    if isinstance(data, str):
        data = data.encode()
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_temps(path: Path) -> list[Path]:
    """Removes what stopped writers of `path` left beside it (`<name>.tmp*`, `<name>.old*`,
    files or folders), logging each. Call it holding the entry's lock: every writer of this
    module holds it while its temporary exists, so whatever is found is a dead writer's."""
    found = sorted(p for p in path.parent.glob(f"{path.name}.*")
                   if p.name.startswith((f"{path.name}.tmp", f"{path.name}.old")))
    for p in found:
        logger.warning("contbatch: %s: left by a writer that did not finish; removed", p)
        _remove(p)
    return found


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


@contextmanager
def locked(path: Path, doing: str) -> Iterator[None]:
    """Holds an exclusive `flock` on `path` (created if absent) for the block.

    Waits while another process (or thread: each call opens its own file description) holds
    it, and says so in one warning line naming the holder's process id and `doing`, so a wait
    is never silent. A holder that dies releases it at once. Raises OSError where the lock
    file cannot be created (a read-only cache): then nothing could be written either."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            logger.warning("contbatch: waiting for process %s, which is %s (lock %s)", _holder(fd), doing, path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message above, in the next waiter
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, names: Iterable[str], **facts: object) -> None:
    """Records the size and sha256 of each named file of `folder`, and `facts` (what the entry
    was made from, its format), atomically. Written last: an entry without one is unfinished
    or was written by a version that kept no record, and is rebuilt either way."""
    files = {}
    for name in sorted(names):
        path = folder / name
        files[name] = {"size": path.stat().st_size, "sha256": sha256(path)}
    write_atomic(folder / MANIFEST, json.dumps({**facts, "files": files}, indent=1, sort_keys=True))


def check_manifest(folder: Path, hash_limit: int | None = None, **facts: object) -> str | None:
    """None if `folder` holds what its manifest records, else what is wrong, naming the file.

    Every file's size is checked, and the sha256 of those up to `hash_limit` bytes (None: all):
    a large file's digest costs a read of all of it at every load, which its loader does
    anyway and which finds a damaged header there. `facts` must equal those recorded (a
    format or a source that changed since makes the entry stale). Never raises."""
    manifest = folder / MANIFEST
    try:
        record = json.loads(manifest.read_text())
    except FileNotFoundError:
        return f"{manifest}: missing (an unfinished write, or one by a version that kept no record)"
    except (OSError, ValueError) as exc:
        return f"{manifest}: unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict) or not record["files"]:
        return f"{manifest}: not a manifest"
    for key, want in facts.items():
        if record.get(key) != want:
            return f"{manifest}: made for {key}={record.get(key)!r}, now {want!r} (stale)"
    for name, entry in record["files"].items():
        path = folder / name
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
            return f"{manifest}: damaged entry for {name!r}"
        try:
            size = path.stat().st_size
        except OSError:
            return f"{path}: missing"
        if size != entry["size"]:
            return f"{path}: {size} bytes, {entry['size']} written"
        if hash_limit is None or size <= hash_limit:
            try:
                if sha256(path) != entry.get("sha256"):
                    return f"{path}: content differs from what was written (sha256)"
            except OSError as exc:
                return f"{path}: unreadable ({exc})"
    return None


def commit_folder(tmp: Path, out: Path) -> None:
    """Puts the finished folder `tmp` at `out`, replacing what is there: its files synced, then
    renamed in (a folder cannot replace a non-empty one in one rename, so an old one is first
    renamed aside to `<out>.old-*` and removed after). Hold `out`'s lock: readers that do not
    see `out` for that instant take the lock and wait, then find the new one."""
    for path in tmp.rglob("*"):
        if path.is_file():
            fsync_file(path)
    fsync_dir(tmp)
    old = None
    if out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        _remove(old)
