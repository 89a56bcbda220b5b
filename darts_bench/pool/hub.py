"""Hub ids -> local checkpoint dirs, resolved once in the pool stage.

A pool entry is either a local checkpoint dir or a Hugging Face hub id (``org/name``, optionally
``org/name@revision``). Hub ids are resolved with ``huggingface_hub.snapshot_download``: with hub
access it downloads (or reuses) the snapshot in the cache; offline (``HF_HUB_OFFLINE=1``) it
returns the cached snapshot of the requested revision (``refs/<revision>`` in the standard cache
layout ``<HF_HUB_CACHE>/models--org--name/{refs,snapshots,blobs}``). Every later stage gets the
snapshot's local path, never the id.

The cache location is read from the environment at call time: ``HF_HUB_CACHE``, else
``$HF_HOME/hub``, else huggingface_hub's default (``~/.cache/huggingface/hub``). Hashing a
checkpoint's content (for cache keys) is a separate concern, not done here.
"""

from __future__ import annotations

import os
from pathlib import Path

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class HubResolutionError(FileNotFoundError):
    """A pool entry is neither a local dir nor a hub id that can be resolved (offline and not cached,
    unknown repo or revision)."""


def hub_cache_dir() -> Path | None:
    """The hub cache dir named by the environment (``HF_HUB_CACHE``, else ``$HF_HOME/hub``), or
    None for huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return None


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to a true value now (or was when huggingface_hub loaded)."""
    from huggingface_hub import constants

    v = os.environ.get("HF_HUB_OFFLINE", "")
    return v.strip().upper() in ("1", "ON", "YES", "TRUE") or bool(constants.HF_HUB_OFFLINE)


def split_revision(ref: str) -> tuple[str, str | None]:
    """``org/name@rev`` -> (``org/name``, ``rev``); without ``@`` the revision is None."""
    if "@" in ref:
        repo, rev = ref.rsplit("@", 1)
        return repo, rev or None
    return ref, None


def resolve_model(id_or_path: str | Path, revision: str | None = None) -> tuple[Path, str | None]:
    """A local checkpoint dir for a pool entry, and the resolved revision (commit hash).

    Args:
        id_or_path: an existing local dir (returned as is, revision None) or a hub id
            ``org/name`` / ``org/name@revision``.
        revision: branch, tag or commit (default ``main``; an ``@revision`` suffix wins).
    Returns:
        ``(snapshot_dir, commit_hash)``; the commit is the snapshot dir's name in the cache.
    Raises:
        HubResolutionError: not a dir and not a valid hub id, or offline and the revision is not in
            the cache (the message names the id, the revision and the cache dir searched), or the hub
            does not know the repo/revision.
    """
    p = Path(id_or_path).expanduser()
    if p.is_dir():
        return p.resolve(), None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    repo, rev = split_revision(str(id_or_path))
    rev = rev or revision
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise HubResolutionError(f"{id_or_path!r} is neither an existing checkpoint dir nor a hub id "
                                 "(org/name[@revision])") from None
    cache = hub_cache_dir()
    offline = hub_offline()
    where = str(cache) if cache else "huggingface_hub's default cache (~/.cache/huggingface/hub)"
    try:
        path = snapshot_download(repo, revision=rev, cache_dir=cache, local_files_only=offline,
                                 allow_patterns=ALLOW_PATTERNS)
    except LocalEntryNotFoundError:
        raise HubResolutionError(
            f"hub model {repo!r} (revision {rev or 'main'}) is not in the cache {where} and the hub is "
            f"{'disabled (HF_HUB_OFFLINE=1)' if offline else 'unreachable'}: download it where the hub is "
            f"reachable (`hf download {repo}`) into the cache that HF_HOME / HF_HUB_CACHE name here, or "
            "give a local checkpoint dir") from None
    except Exception as e:  # noqa: BLE001 - repository/revision not found, gated, HTTP errors
        raise HubResolutionError(f"cannot resolve hub model {repo!r} (revision {rev or 'main'}, cache {where}): "
                                 f"{type(e).__name__}: {e}") from None
    path = Path(path)
    return path, path.name
