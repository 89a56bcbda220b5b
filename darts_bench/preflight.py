"""What a run will meet, checked before any stage, every problem collected (not the first raised).

:func:`pool_problems` looks at an ``hf`` pool's checkpoints without loading a model: each entry is a
local dir or a hub id in the cache (offline), has ``config.json``, its safetensors weights (sharded:
``model.safetensors.index.json`` present and every shard it lists), a tokenizer, the base's
architecture and shapes and vocabulary, and only finite weights (every tensor read lazily, one at a
time, NaN / inf named by expert and tensor; the result remembered by file size and mtime in
``<work_dir>/pool/finite-memo.json`` so a second run does not read the weights again).
:func:`row_problems` checks the rows the config makes: every task's expert is in the pool, the models a
task calls (the AlpacaEval judge) are rows or dirs, and task-agnostic rows (routed / shared) have two
tasks with calibration features.

Each problem is a :class:`Problem`: what failed, where (file, expert, tensor, row, key) and the fix;
``str()`` is the three lines ``darts-bench validate`` prints. ``darts-bench validate`` and ``run``
(:func:`darts_bench.listing.validate`) report them all at once.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("darts_bench")

INDEX_NAME = "model.safetensors.index.json"
#: config.json fields every expert must share with the base
SHAPE_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Problem:
    """One thing the run would fail on: ``check`` (the area: pool, rows, tasks ...), ``what`` failed,
    ``where`` (file, expert, tensor, row or config key) and the ``fix``."""

    check: str
    what: str
    where: str = ""
    fix: str = ""

    def __str__(self) -> str:
        out = f"{self.check}: {self.what}"
        if self.where:
            out += f"\n  where: {self.where}"
        if self.fix:
            out += f"\n  fix: {self.fix}"
        return out


# ------------------------------------------------------------------------------------------ pool
def _resolve_entry(name: str, ref: str) -> tuple[Path | None, Problem | None]:
    """A pool entry's local dir: the dir itself, or a hub id's cached snapshot. Online, a hub id not in
    the cache is left to the pool stage (it downloads it): ``(None, None)``."""
    p = Path(ref).expanduser()
    if p.is_dir():
        return p.resolve(), None
    who = "base" if name == "base" else f"expert {name!r}"
    looks_local = ref.startswith((".", "/", "~")) or ref.count("/") != 1
    if looks_local:
        return None, Problem("pool", f"{who}: {ref!r} does not exist (not a checkpoint dir, and not a hub id "
                             "org/name)", where=f"pool.{'base' if name == 'base' else 'experts.' + name}",
                             fix="give the path of a checkpoint dir (config.json + *.safetensors + tokenizer), or "
                             "a hub id org/name[@revision]")
    from darts_bench.pool.hub import hub_offline, split_revision

    repo, rev = split_revision(ref)
    try:
        from huggingface_hub import snapshot_download

        from darts_bench.pool.hub import ALLOW_PATTERNS, hub_cache_dir

        return Path(snapshot_download(repo, revision=rev, cache_dir=hub_cache_dir(), local_files_only=True,
                                      allow_patterns=ALLOW_PATTERNS)), None
    except Exception:  # noqa: BLE001 - not cached (or not a valid id)
        if not hub_offline():
            return None, None  # the pool stage downloads it
        return None, Problem("pool", f"{who}: hub model {ref!r} is not in the local hub cache and the hub is "
                             "offline (HF_HUB_OFFLINE=1)", where=f"pool.{'base' if name == 'base' else 'experts.' + name}",
                             fix=f"download it where the hub is reachable (`hf download {repo}`) into the cache "
                             "HF_HOME / HF_HUB_CACHE name here, or give a local checkpoint dir")


def _weight_files(name: str, d: Path, problems: list[Problem]) -> list[Path]:
    """The safetensors files of checkpoint ``d``; problems for a missing index or shard, or no weights."""
    index = d / INDEX_NAME
    files = sorted(d.glob("*.safetensors"))
    if index.is_file():
        try:
            listed = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        except (OSError, ValueError) as e:
            problems.append(Problem("pool", f"{name}: unreadable shard index ({e})", where=str(index),
                                    fix="re-save the checkpoint (save_pretrained) or restore the file"))
            return files
        missing = [f for f in listed if not (d / f).is_file()]
        if missing:
            problems.append(Problem("pool", f"{name}: shard(s) {missing} listed in the shard index are missing",
                                    where=str(index), fix="restore the missing shard files (or re-download)"))
        return [d / f for f in listed if (d / f).is_file()]
    if not files:
        problems.append(Problem("pool", f"{name}: no weights (*.safetensors) in the checkpoint dir", where=str(d),
                                fix="save the model with save_pretrained(safe_serialization=True) (.bin weights "
                                "are not read)"))
    elif len(files) > 1:
        problems.append(Problem("pool", f"{name}: {len(files)} safetensors shards but no {INDEX_NAME}",
                                where=str(d / INDEX_NAME), fix="restore the shard index that save_pretrained wrote "
                                "beside the shards (it maps each tensor to its shard), or re-save the model"))
    return files


class _FiniteMemo:
    """Which tensors of a safetensors file are not finite, remembered by (path, size, mtime)."""

    def __init__(self, path: Path | None):
        self.path, self.data, self.dirty = path, {}, False
        if path is not None and path.is_file():
            try:
                self.data = json.loads(path.read_text())
            except (OSError, ValueError):
                self.data = {}

    @staticmethod
    def _key(f: Path) -> str:
        st = f.stat()
        return f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"

    def get(self, f: Path) -> list[str] | None:
        return self.data.get(self._key(f))

    def put(self, f: Path, bad: list[str]) -> None:
        self.data[self._key(f)] = bad
        self.dirty = True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        from darts_bench.artifacts import atomic_write_text

        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.data, indent=0, sort_keys=True))


def nonfinite_tensors(f: Path) -> list[str]:
    """Names of the tensors of safetensors file ``f`` holding a NaN or inf, each read on its own.

    Raises:
        ValueError: the file is corrupt (header or byte ranges)."""
    import torch
    from safetensors import safe_open

    bad = []
    try:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad.append(k)
    except Exception as e:  # noqa: BLE001 - any failure means the file is unusable
        raise ValueError(f"corrupt safetensors file ({type(e).__name__}: {e})") from None
    from darts_bench.pool.checkpoint import check_safetensors_length

    try:
        check_safetensors_length(f)
    except ValueError as e:
        raise ValueError(f"corrupt safetensors file (truncated or padded: {e})") from None
    return bad


def _vocab(d: Path) -> dict[str, int] | None:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d)).get_vocab()


def pool_problems(cfg, work_dir: Path | None = None, scan_weights: bool = True) -> list[Problem]:
    """Every problem of an ``hf`` pool's checkpoints (module docstring); ``[]`` for the built pools (the
    pool stage builds and checks them). ``work_dir``: where the finite-weights memo is read and, when it
    exists, written; ``scan_weights``: read every tensor for NaN / inf (else only the files' layout)."""
    pc = cfg.pool
    if pc.kind != "hf":
        return []
    problems: list[Problem] = []
    dirs: dict[str, Path] = {}
    for name, ref in {"base": pc.base, **{e: pc.experts[e] for e in pc.expert_names}}.items():
        d, prob = _resolve_entry(name, str(ref))
        if prob:
            problems.append(prob)
        if d is not None:
            dirs[name] = d
    memo_path = Path(work_dir) / "pool" / "finite-memo.json" if work_dir is not None else None
    memo = _FiniteMemo(memo_path)
    configs: dict[str, dict] = {}
    for name, d in dirs.items():
        who = "base" if name == "base" else f"expert {name!r}"
        cj = d / "config.json"
        if not cj.is_file():
            problems.append(Problem("pool", f"{who}: not a model checkpoint (no config.json)", where=str(d),
                                    fix="point the pool at the dir save_pretrained wrote"))
        else:
            try:
                configs[name] = json.loads(cj.read_text())
            except ValueError as e:
                problems.append(Problem("pool", f"{who}: config.json is not JSON ({e})", where=str(cj),
                                        fix="restore config.json"))
        if not any((d / f).is_file() for f in TOKENIZER_FILES):
            problems.append(Problem("pool", f"{who}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])})",
                                    where=str(d), fix="save the tokenizer beside the weights (tokenizer.save_pretrained)"))
        files = _weight_files(who, d, problems)
        if not scan_weights:
            continue
        for f in files:
            bad = memo.get(f)
            if bad is None:
                try:
                    bad = nonfinite_tensors(f)
                except ValueError as e:
                    problems.append(Problem("pool", f"{who}: {e}", where=str(f),
                                            fix="re-download or re-save the checkpoint"))
                    continue
                memo.put(f, bad)
            for k in bad:
                problems.append(Problem("pool", f"{who}: tensor {k} holds NaN or inf values", where=f"{f} : {k}",
                                        fix="fix or re-export the checkpoint (a diverged fine-tune, or an overflow "
                                        "when it was cast to a narrower dtype)"))
    if memo_path is not None and memo_path.parent.parent.is_dir():
        memo.save()  # only where the work dir exists (validate creates nothing)
    base_cfg = configs.get("base")
    base_vocab = None
    if "base" in dirs:
        try:
            base_vocab = _vocab(dirs["base"])
        except Exception as e:  # noqa: BLE001 - transformers' errors, restated
            problems.append(Problem("pool", f"base: the tokenizer does not load ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''})", where=str(dirs["base"]),
                                    fix="save a tokenizer transformers can load (tokenizer.save_pretrained)"))
    for name in pc.expert_names:
        if name not in dirs:
            continue
        where = f"pool.experts.{name} ({dirs[name]})"
        ecfg = configs.get(name)
        if base_cfg is not None and ecfg is not None:
            for k in SHAPE_KEYS:
                if k == "vocab_size" and pc.vocab_alignment == "base" and (ecfg.get(k) or 0) >= (base_cfg.get(k) or 0):
                    continue
                if base_cfg.get(k) != ecfg.get(k):
                    fix = ("fine-tune experts from this base, or point pool.base at the experts' own base")
                    if k == "vocab_size":
                        fix = ("re-save the expert with the base's (padded) vocabulary, or set pool.vocab_alignment: "
                               "base if the expert only appends tokens to the base's")
                    problems.append(Problem("pool", f"expert {name!r} does not match the base: {k} = {ecfg.get(k)!r} "
                                            f"vs base {base_cfg.get(k)!r}", where=where, fix=fix))
        if base_vocab is None:
            continue
        try:
            ev = _vocab(dirs[name])
        except Exception as e:  # noqa: BLE001 - transformers' errors, restated
            problems.append(Problem("pool", f"expert {name!r}: the tokenizer does not load ({type(e).__name__})",
                                    where=where, fix="save a tokenizer beside the expert's weights"))
            continue
        if ev != base_vocab:
            from darts_bench.pool.build import _appended_tokens

            if pc.vocab_alignment == "base" and _appended_tokens(base_vocab, ev) is not None:
                continue
            diff = sorted(set(ev.items()) ^ set(base_vocab.items()))[:3]
            problems.append(Problem("pool", f"expert {name!r} has a different tokenizer vocabulary from the base: "
                                    f"{len(ev)} vs {len(base_vocab)} tokens, first differences {diff}", where=where,
                                    fix="experts must share the base's tokenizer (pool.vocab_alignment: base accepts "
                                    "tokens appended after the base's only)"))
    return problems


# ------------------------------------------------------------------------------------------ rows
def row_problems(cfg, task_names: list[str]) -> list[Problem]:
    """The rows the config makes, against the pool and the tasks: each task's expert exists; each model a
    task calls (``Task.models_used``: the AlpacaEval judge) is a row of the config or a checkpoint dir;
    selected routed / shared rows have two or more tasks with calibration features (an expert)."""
    from darts_bench.api import get_task
    from darts_bench.rows import ROUTING_KINDS, row_names, row_selected, row_specs

    problems: list[Problem] = []
    experts = cfg.pool.expert_names
    for t in task_names:
        e = cfg.tasks.expert(t)
        if e is not None and e not in experts:
            problems.append(Problem("tasks", f"task {t} maps to expert {e!r}, which the pool does not have (experts: "
                                    f"{list(experts)})", where=f"tasks.{t}.expert",
                                    fix=f"set tasks.{t}.expert to one of {list(experts)}, or to null (no heads for "
                                    "this task)"))
    names = row_names(cfg)
    for t in task_names:
        tcfg = getattr(cfg.tasks, t)
        for m in get_task(t, tcfg).models_used(tcfg):
            if m in names or Path(m).expanduser().is_dir():
                continue
            near = _nearest(m, names)
            problems.append(Problem("rows", f"task {t} calls model {m!r}, which is neither a row of this config nor a "
                                    "checkpoint dir", where=f"tasks.{t} (e.g. tasks.{t}.judge.model)",
                                    fix="name one of the rows (darts-bench ls rows)" +
                                    (f", e.g. {', '.join(near)}" if near else "") +
                                    ", or a checkpoint dir"))
    agnostic = [s.model for s in row_specs(cfg) if s.routing in ROUTING_KINDS and not s.task_aware
                and row_selected(cfg, s.model)]
    with_features = [t for t in task_names if cfg.tasks.expert(t) is not None]
    emr_routed = [s.model for s in row_specs(cfg) if s.task_aware and s.routing == "routed"
                  and row_selected(cfg, s.model)]
    if emr_routed and len(with_features) < 2:
        problems.append(Problem("rows", f"task-aware routed row(s) {emr_routed} route between two or more tasks with "
                                f"an expert, the suite has {with_features}", where="merges (method emr)",
                                fix="add a task with an expert to --suite, or leave these rows out: --rows without "
                                "*@routed*"))
    no_model = [t for t in task_names if cfg.tasks.expert(t) is None]
    emr_oracle = [s.model for s in row_specs(cfg) if s.task_aware and s.routing == "oracle"
                  and row_selected(cfg, s.model)]
    if emr_oracle and no_model:
        problems.append(Problem("rows", f"task-aware row(s) {emr_oracle} run each task on its expert's model, and "
                                f"task(s) {no_model} have no expert", where="merges (method emr)",
                                fix=f"set tasks.<task>.expert for {no_model}, or leave the rows out (--rows)"))
    if agnostic and len(with_features) < 2:
        problems.append(Problem("rows", f"{len(agnostic)} task-agnostic row(s) (routed / shared, e.g. {agnostic[0]}) "
                                f"need two or more tasks with calibration features (an expert), the suite has "
                                f"{with_features}", where="surgery.task_agnostic " + str(list(cfg.surgery.task_agnostic)),
                                fix="add a task with an expert to --suite, or drop these rows: --set "
                                "surgery.task_agnostic=[] (or --rows without *@routed* / *@shared*)"))
    return problems


def _nearest(word: str, names: list[str], n: int = 3) -> list[str]:
    import difflib

    return difflib.get_close_matches(word, names, n=n, cutoff=0.5)


def nearest_names(word: str, names: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``names`` closest to ``word`` (difflib), for a did-you-mean."""
    return _nearest(word, names, n)


def env_offline_default(data_dir: str | None) -> list[str]:
    """Set ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` to 1 in this process when a data dir is given
    (``data_dir`` or ``DARTS_BENCH_DATA``) and the user set neither: the data dir holds what the tasks
    read, so no evaluation asks the hub (and retries it). Returns the variables set (for one log line)."""
    if not (data_dir or os.environ.get("DARTS_BENCH_DATA")):
        return []
    set_now = []
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if v not in os.environ:
            os.environ[v] = "1"
            set_now.append(v)
    return set_now


__all__ = ["Problem", "env_offline_default", "nearest_names", "nonfinite_tensors", "pool_problems", "row_problems"]
