"""Checkpoint content fingerprints for the pool's cache keys (bring-your-own weights by content).

A checkpoint dir (a local model dir or a hub snapshot dir) is identified by the sha256 of every
file that can change the numbers: weights (``*.safetensors`` shards, ``*.bin``), the safetensors
index, ``config.json``, ``generation_config.json``, tokenizer files and chat templates. Docs
(``*.md``), ``.gitattributes`` and hidden files/dirs are left out. Retraining an expert and
saving it at the same path therefore changes its fingerprint, and with it the keys of every
artifact built from it.

Hashing a 13 GB checkpoint takes about a minute, so each file's sha256 is remembered in a small
JSON memo (``<work_dir>/pool/hash-memo.json``) under ``(resolved path, size, mtime_ns)``: a file
is re-read only when one of those changes (any rewrite updates ``mtime_ns``). A file replaced by
different bytes of the same size while its ``mtime_ns`` is set back by hand (``touch -d``,
``cp -p``/``rsync -t`` of another file over it) would not be re-read; delete the memo to force
re-hashing.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from darts_bench.artifacts import atomic_write_text, file_sha256, stable_hash

log = logging.getLogger("darts_bench")
MEMO_NAME = "hash-memo.json"
_IGNORED_SUFFIXES = (".md",)
_IGNORED_NAMES = (".gitattributes",)


class HashMemo:
    """sha256 of files remembered by ``(resolved path, size, mtime_ns)`` in one JSON file.

    ``path=None`` keeps the memo in memory only. Writes are atomic (temp file + rename); two
    processes sharing a work dir may each drop the other's new entries, which only costs a re-hash.
    """

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._entries: dict[str, dict] = {}
        self.hashed: list[str] = []  # files actually read (not served from the memo), this process
        if self.path and self.path.is_file():
            try:
                self._entries = json.loads(self.path.read_text())["files"]
            except (json.JSONDecodeError, KeyError, TypeError):
                log.warning("hash memo %s is unreadable; checkpoint files will be re-hashed", self.path)

    def sha256(self, file: Path) -> str:
        """The file's hex sha256, read from disk only if its size or ``mtime_ns`` changed."""
        real = Path(file).resolve()  # hub snapshots are symlinks into blobs/
        st = real.stat()
        rec = self._entries.get(str(real))
        if rec and rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns:
            return rec["sha256"]
        digest = file_sha256(real)
        with self._lock:
            self._entries[str(real)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
            self.hashed.append(str(real))
        return digest

    def save(self) -> None:
        if self.path is None:
            return
        with self._lock:
            atomic_write_text(self.path, json.dumps({"files": self._entries}, indent=1, sort_keys=True))


def checkpoint_files(model_dir: Path) -> list[Path]:
    """Files of a checkpoint dir that enter its fingerprint, sorted by path."""
    model_dir = Path(model_dir)
    out = []
    for p in sorted(model_dir.rglob("*")):
        rel = p.relative_to(model_dir)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if p.name in _IGNORED_NAMES or p.suffix in _IGNORED_SUFFIXES:
            continue
        out.append(p)
    return out


def hub_revision(model_dir: Path) -> str | None:
    """The commit hash of a hub snapshot dir (``.../models--org--name/snapshots/<commit>``), else None."""
    p = Path(model_dir).absolute()
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.name
    return None


def checkpoint_fingerprint(model_dir: Path, memo: HashMemo) -> dict:
    """Content fingerprint of one checkpoint dir.

    Returns:
        ``{"files": {relative path: sha256}, "bytes": total size in bytes, "revision": hub commit
        hash or None, "key": 16-hex digest of files + revision}``.
    Raises:
        FileNotFoundError: ``model_dir`` is not a directory or holds no files.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"checkpoint dir not found: {model_dir}")
    files = checkpoint_files(model_dir)
    if not files:
        raise FileNotFoundError(f"checkpoint dir {model_dir} holds no files")
    total = sum(f.resolve().stat().st_size for f in files)
    n_before, t0 = len(memo.hashed), time.perf_counter()
    hashes = {str(f.relative_to(model_dir)): memo.sha256(f) for f in files}
    fresh = memo.hashed[n_before:]
    if fresh:
        log.info("hashed %d file(s) of %s (%.2f GB in the dir) in %.1f s; remembered in %s", len(fresh), model_dir,
                 total / 1e9, time.perf_counter() - t0, memo.path or "memory")
    rev = hub_revision(model_dir)
    return {"files": hashes, "bytes": total, "revision": rev, "key": stable_hash({"files": hashes, "revision": rev})}


def pool_fingerprints(dirs: dict[str, Path], work_dir: Path | None) -> dict[str, dict]:
    """:func:`checkpoint_fingerprint` of each named dir (``base``, expert names), sharing one memo
    under ``<work_dir>/pool/`` (in memory only when ``work_dir`` is None)."""
    memo = HashMemo(Path(work_dir) / "pool" / MEMO_NAME if work_dir is not None else None)
    out = {name: checkpoint_fingerprint(d, memo) for name, d in dirs.items()}
    if memo.hashed:
        memo.save()
    return out
