"""The feature store: how hidden-state features are laid out on disk and on the wire.

One feature artifact is a folder of safetensors shards plus an ``index.json``:

* shard ``<prefix>-<i:05d>.safetensors`` (``prefix``: ``expert`` | ``merged``; ``i``: the shard
  index, shards of ``ray.shard_size`` sequences in a fixed order) holds, for every real token of
  its sequences: ``h`` ``[n, d_model]`` in the model's dtype (float32 on the tiny tier, bfloat16 at
  scale), ``entropy`` ``[n]`` float32 (the next-token entropy, nats; a merged model's only when a
  surgery variant reads it: :func:`darts_bench.rows.merged_entropy_needed`), ``positions`` ``[n]`` int64
  (absolute, from 0) and ``seq_index`` ``[n]`` int64 (index of the sequence in the whole artifact);
  tokens in sequence order;
* ``index.json``: ``{"shards": [names], "n_sequences": N, "n_tokens": [per shard], "dtype": h's
  dtype name}``.

Writers (:mod:`darts_bench.collect.features`) persist each shard atomically as it finishes
(:func:`write_shard`) so a resumed run redoes only missing shards (:func:`shard_is_complete`), and
write the index last (:func:`write_index`). Workers send features as numpy
(:func:`encode_features`, bf16 as its int16 bit pattern; :func:`decode_features` inverts it
bit-exactly). Readers (:mod:`darts_bench.surgery.data`) never concatenate a whole artifact:
:class:`ShardedFeatures` reads it shard by shard through safetensors' memory-mapped ``safe_open``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

#: safetensors dtype codes -> torch dtype names (``index.json``'s ``dtype``)
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64"}
COLUMNS = ("h", "entropy", "positions", "seq_index")


def shard_name(prefix: str, i: int) -> str:
    """File name of shard ``i`` of a ``prefix`` (``expert`` | ``merged``) artifact."""
    return f"{prefix}-{i:05d}.safetensors"


def check_finite(feats: dict[str, torch.Tensor], where: str) -> None:
    """Raises ``FloatingPointError`` naming ``where`` and the column if a float column holds NaN/inf."""
    for k, v in feats.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            n = int((~torch.isfinite(v)).sum())
            raise FloatingPointError(f"{n} non-finite values in {k} of {where}; the model produced NaN/inf "
                                     "(check the checkpoint and dtype)")


def write_shard(folder: Path, prefix: str, i: int, feats: dict[str, torch.Tensor]) -> Path:
    """Write shard ``i`` into ``folder`` atomically (a temp file, then a rename); returns its path."""
    tmp = folder / f".tmp-{shard_name(prefix, i)}"
    save_file({k: v.contiguous() for k, v in feats.items()}, str(tmp))
    final = folder / shard_name(prefix, i)
    tmp.replace(final)
    return final


def shard_is_complete(path: Path) -> bool:
    """Whether ``path`` is a readable shard; a torn one (from a killed run) is deleted."""
    if not path.is_file():
        return False
    try:
        load_file(str(path))
        return True
    except Exception:  # noqa: BLE001 - any read failure means the shard must be redone
        path.unlink()
        return False


def write_index(folder: Path, shards: list[str], n_sequences: int) -> dict[str, Any]:
    """Write ``folder/index.json`` for ``shards`` (already in ``folder``), reading each shard's
    token count and ``h`` dtype from its header; returns the index."""
    index: dict[str, Any] = {"shards": [], "n_sequences": n_sequences, "n_tokens": [], "dtype": None}
    for name in shards:
        index["shards"].append(name)
        with safe_open(str(folder / name), "pt") as st:
            sl = st.get_slice("h")
            index["n_tokens"].append(int(sl.get_shape()[0]))
            index["dtype"] = ST_DTYPES[sl.get_dtype()]
    (folder / "index.json").write_text(json.dumps(index))
    return index


def encode_features(feats: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Features as numpy arrays for the trip from a worker (numpy has no bfloat16: a bf16 tensor
    travels as its int16 bit pattern, its dtype named under ``"dtypes"``). Inverse:
    :func:`decode_features`."""
    out: dict[str, Any] = {"dtypes": {}}
    for k, v in feats.items():
        if v.dtype == torch.bfloat16:
            out["dtypes"][k] = "bfloat16"
            v = v.view(torch.int16)
        out[k] = v.numpy()
    return out


def decode_features(res: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors from :func:`encode_features`' output (bit-exact)."""
    dtypes = res.get("dtypes", {})
    out = {}
    for k, v in res.items():
        if k == "dtypes":
            continue
        t = torch.from_numpy(np.asarray(v))
        out[k] = t.view(getattr(torch, dtypes[k])) if k in dtypes else t
    return out


def regroup(src: Path, batch_files: list[str], out: Path, prefix: str, n_sequences: int,
            shard_size: int) -> list[str]:
    """Write the store's shards (``prefix``, ``shard_size`` sequences each in stored order, tokens in
    order) into ``out`` from feature files in ``src`` that hold whole sequences in any grouping (the
    length-sorted forward batches of :func:`darts_bench.collect.features._run_sharded`; ``seq_index``
    names each token's sequence). Reads through memory maps, one output shard in memory at a time;
    returns the shard names.

    Raises:
        ValueError: a sequence is missing, or is split across files.
    """
    where: dict[int, tuple[Path, int, int]] = {}  # sequence -> (file, first row, end row)
    columns: tuple[str, ...] | None = None  # COLUMNS the batch files hold (every file the same)
    for name in batch_files:
        with safe_open(str(src / name), "pt") as st:
            seq = st.get_tensor("seq_index")
            have = tuple(c for c in COLUMNS if c in st.keys())
        if columns is not None and have != columns:
            raise ValueError(f"{src / name} holds the columns {have}, an earlier feature file {columns}")
        columns = have
        if not len(seq):
            continue
        cuts = (torch.nonzero(seq[1:] != seq[:-1])[:, 0] + 1).tolist()
        for a, b in zip([0, *cuts], [*cuts, len(seq)]):
            j = int(seq[a])
            if j in where:
                raise ValueError(f"sequence {j} is in more than one place ({where[j][0].name}, {name})")
            where[j] = (src / name, a, b)
    missing = [j for j in range(n_sequences) if j not in where]
    if missing:
        raise ValueError(f"{len(missing)} of {n_sequences} sequences have no features in {src} (first: {missing[0]})")
    names = []
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}  # each batch file opened once (memory-mapped), closed at the end
        for k, start in enumerate(range(0, n_sequences, shard_size)):
            parts: dict[str, list[torch.Tensor]] = {c: [] for c in columns or COLUMNS}
            for j in range(start, min(start + shard_size, n_sequences)):
                path, a, b = where[j]
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(str(path), "pt"))
                for c in parts:
                    parts[c].append(handles[path].get_slice(c)[a:b])
            write_shard(out, prefix, k, {c: torch.cat(v) for c, v in parts.items()})
            names.append(shard_name(prefix, k))
    return names


def load_shards(root: Path) -> dict[str, torch.Tensor]:
    """Concatenate the shards listed in ``root/index.json`` (tokens in sequence order).

    Holds every shard and the concatenation at once (about twice the artifact): small artifacts
    and tests only; the pipeline reads through :class:`ShardedFeatures`."""
    index = json.loads((root / "index.json").read_text())
    parts = [load_file(str(root / s)) for s in index["shards"]]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


class ShardedFeatures:
    """Read-only access to one feature artifact (``index.json`` + safetensors shards) without
    concatenating it: each shard is opened memory-mapped with ``safetensors.safe_open``.

    Columns: ``h`` ``[N, d]`` in the stored dtype (the model's), ``entropy`` ``[N]`` float32
    (nats), ``positions`` / ``seq_index`` ``[N]`` int64; N = tokens over all shards, in sequence order.

    Raises:
        FileNotFoundError: no ``index.json`` or a listed shard is missing.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        f = self.root / "index.json"
        if not f.is_file():
            raise FileNotFoundError(f"feature index missing: {f}")
        index = json.loads(f.read_text())
        self.files = [self.root / s for s in index["shards"]]
        lengths, dtype, d, keys = [], None, None, None
        for p in self.files:
            if not p.is_file():
                raise FileNotFoundError(f"feature shard missing: {p} (listed in {f})")
            with safe_open(str(p), "pt") as st:
                keys = set(st.keys()) if keys is None else keys
                sl = st.get_slice("h")
                shape = sl.get_shape()
                lengths.append(int(shape[0]))
                dtype, d = ST_DTYPES[sl.get_dtype()], int(shape[1])
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.dtype, self.d = index.get("dtype") or dtype, d
        # the columns it holds (the first shard's; a merged model's entropy is optional): COLUMNS order
        self.columns = tuple(c for c in COLUMNS if keys is None or c in keys)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def has(self, key: str) -> bool:
        """Whether the artifact holds column ``key`` (a merged model's ``entropy`` is optional)."""
        return key in self.columns

    def _check_column(self, key: str) -> None:
        if not self.has(key):
            why = (": a merged model's next-token entropy is collected only when a surgery variant reads it "
                   "(surgery.entropy_source: merged), and then under another cache key; collect again with that "
                   "setting") if key == "entropy" else ""
            raise KeyError(f"feature artifact {self.root} has no {key!r} column{why}")

    def column(self, key: str) -> torch.Tensor:
        """A 1-D column (``entropy``, ``positions``, ``seq_index``) for all tokens (small: ``[N]``).

        Raises:
            KeyError: the artifact has no such column (a merged model's ``entropy`` collected without it)."""
        self._check_column(key)
        parts = []
        for p in self.files:
            with safe_open(str(p), "pt") as st:
                parts.append(st.get_tensor(key))
        return torch.cat(parts)

    def read_h(self) -> torch.Tensor:
        """``h`` for all tokens, ``[N, d]`` in the stored dtype, filled shard by shard into one
        preallocated tensor (peak: the tensor + one shard)."""
        out = torch.empty((len(self), self.d), dtype=getattr(torch, self.dtype))
        for p, o, n in zip(self.files, self.offsets, self.lengths):
            with safe_open(str(p), "pt") as st:
                out[o:o + n] = st.get_tensor("h")
        return out

    def shards(self, keys: tuple[str, ...] | None = None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield ``(offset, {key: tensor})`` per shard, one shard in memory at a time.

        Raises:
            KeyError: a key the artifact has no column of (:meth:`column`); None: every column it has."""
        if keys is None:
            keys = self.columns
        for k in keys:
            self._check_column(k)
        for p, o in zip(self.files, self.offsets):
            with safe_open(str(p), "pt") as st:
                yield int(o), {k: st.get_tensor(k) for k in keys}
