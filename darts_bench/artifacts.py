"""Content-addressed, atomically written artifacts.

An artifact is a directory ``<work_dir>/<kind>/<key>`` where ``key`` hashes the artifact's config
and its inputs' keys. It is built in a temp dir next to its final place and renamed when complete,
with a ``_manifest.json`` listing every file's size and sha256. A reader verifies the manifest; a
missing or mismatched file means the artifact is corrupt and it is rebuilt, never used.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger("darts_bench")
MANIFEST = "_manifest.json"


def stable_hash(obj: Any, n: int = 16) -> str:
    """Hex sha256 (first ``n`` chars) of the canonical JSON of ``obj``."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def write_manifest(root: Path, meta: dict[str, Any] | None = None) -> None:
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(root))] = {"size": p.stat().st_size, "sha256": file_sha256(p)}
    (root / MANIFEST).write_text(json.dumps({"files": files, "meta": meta or {}}, indent=1, sort_keys=True))


DEEP_VERIFY_MAX_BYTES = 256 << 20


def verify(root: Path, deep: bool = True) -> str | None:
    """``None`` if ``root`` is a complete artifact, else the reason it is not.

    Every file's presence and size are checked; with ``deep``, files up to
    :data:`DEEP_VERIFY_MAX_BYTES` (256 MiB: feature shards, heads, results, small checkpoints) are
    also re-hashed, so a same-size corruption is caught there, while multi-GB checkpoints are not
    re-read on every command (their sha256 stays in the manifest for ``darts-bench`` to report)."""
    mf = root / MANIFEST
    if not mf.is_file():
        return f"no {MANIFEST}"
    try:
        files = json.loads(mf.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as e:
        return f"unreadable manifest ({e})"
    for rel, info in files.items():
        p = root / rel
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != info["size"]:
            return f"size mismatch for {rel}"
        if deep and info["size"] <= DEEP_VERIFY_MAX_BYTES and file_sha256(p) != info["sha256"]:
            return f"hash mismatch for {rel}"
    return None


@contextmanager
def atomic_dir(final: Path, meta: dict[str, Any] | None = None) -> Iterator[Path]:
    """Yield a temp dir beside ``final``; on success write the manifest and rename it into place
    (replacing a stale ``final``); on error remove the temp dir, leaving ``final`` untouched."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / _temp_name(final.name)
    tmp.mkdir()
    try:
        yield tmp
        write_manifest(tmp, meta)
        if final.exists():
            trash = final.parent / _temp_name("old-" + final.name)
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file and ``os.replace``."""
    atomic_write_bytes(path, text.encode())


def _write_through(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` into the existing non-regular file ``path`` (a device, a FIFO), as a shell's
    ``>`` would: no temp file, no rename, nothing created."""
    fifo = stat.S_ISFIFO(mode)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | (os.O_NONBLOCK if fifo else 0))
    except OSError as e:
        if fifo and e.errno == errno.ENXIO:
            raise OSError(errno.ENXIO, f"{path} is a FIFO with no reader: nothing was written") from None
        raise
    try:
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file and ``os.replace``. The atomic rename applies
    only to a regular file (or a new path): a device or FIFO is written through (``--out
    /dev/null`` keeps ``/dev/null``), a directory or socket is refused, and a symlink is followed
    (its target is replaced, the link stays).

    Raises:
        IsADirectoryError: ``path`` is a directory.
        OSError: ``path`` is a socket, a FIFO without a reader, or cannot be written.
    """
    path = Path(path)
    try:
        st = os.stat(path)  # follows symlinks: what a write would reach
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, f"{path} is a directory: refusing to write a file over it")
        if stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is a socket: refusing to write a file over it")
        _write_through(path, data, st.st_mode)
        return
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / _temp_name(path.name)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def cached(final: Path, build: Callable[[Path], None], what: str, meta: dict[str, Any] | None = None,
           deep_verify: bool = True) -> Path:
    """Return ``final`` if it verifies, else build it atomically with ``build(tmp_dir)``.

    Logs whether the artifact was reused, rebuilt (with the reason) or built, and the time taken.
    """
    if final.exists():
        why = verify(final, deep=deep_verify)
        if why is None:
            log.info("%s: cached (%s)", what, final)
            return final
        log.warning("%s: cached artifact at %s is corrupt (%s); rebuilding", what, final, why)
    t0 = time.perf_counter()
    with atomic_dir(final, meta) as tmp:
        build(tmp)
    log.info("%s: built in %.1f s (%s)", what, time.perf_counter() - t0, final)
    return final


def _temp_name(name: str) -> str:
    """``.darts-tmp-<pid>-<random>-<name>``: the writer's pid lets a cleaner spare live writers."""
    return f".darts-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temps(work_dir: Path) -> int:
    """Remove temp files/dirs (``.darts-tmp-<pid>-*``) left by killed runs, sparing those of live
    processes (another run sharing the work dir); returns how many were removed."""
    n = 0
    if work_dir.is_dir():
        for p in list(work_dir.rglob(".darts-tmp-*")):
            m = re.match(r"\.darts-tmp-(\d+)-", p.name)
            if m and int(m.group(1)) != os.getpid() and _pid_alive(int(m.group(1))):
                continue
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            n += 1
    return n
