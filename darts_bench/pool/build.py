"""Pool construction, caching and the compatibility checks run before any merge."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from darts_bench.artifacts import cached, file_sha256, stable_hash
from darts_bench.config import EXPERT_NAMES, Config
from darts_bench.data import EXPERT_DATA, require_file
from darts_bench.pool.hashing import pool_fingerprints

log = logging.getLogger("darts_bench")


class PoolMismatchError(ValueError):
    """Experts that cannot be merged with the base (architecture, size or vocabulary differ)."""


@dataclass(frozen=True)
class Pool:
    """Checkpoint dirs of the base and each expert, and the pool's cache key.

    ``members``: per-model cache keys (``base`` and each expert name) where the pool knows them
    from the checkpoints' content (``hf`` pools); see :meth:`model_key`."""

    base: Path
    experts: dict[str, Path]
    key: str
    report: dict = field(default_factory=dict, compare=False)
    members: dict[str, str] = field(default_factory=dict)

    def model_key(self, name: str) -> str:
        """Cache key of one pool model (``base``, ``<expert>`` or ``expert:<expert>``): its content
        key in an ``hf`` pool (so retraining one expert leaves the others' artifacts valid), else
        derived from the pool key (built pools are rebuilt as a whole)."""
        n = name.split(":", 1)[1] if name.startswith("expert:") else name
        return self.members.get(n) or stable_hash([self.key, n])

    def path(self, name: str) -> Path:
        """``base`` or ``expert:<name>`` / ``<name>`` -> checkpoint dir."""
        if name == "base":
            return self.base
        e = name.split(":", 1)[1] if name.startswith("expert:") else name
        if e not in self.experts:
            raise KeyError(f"no expert {e!r} in pool (have {sorted(self.experts)})")
        return self.experts[e]


def data_fingerprint(data_dir: Path | None) -> dict[str, str]:
    """sha256 of each expert-training file (part of the pool's cache key)."""
    return {e: file_sha256(require_file(data_dir, rel)) for e, (rel, _) in EXPERT_DATA.items()}


def _read_json(p: Path) -> dict:
    if not p.is_file():
        raise PoolMismatchError(f"missing {p.name} in checkpoint dir {p.parent}")
    return json.loads(p.read_text())


def check_compatible(base: Path | str, experts: dict[str, Path | str], vocab_alignment: str = "error") -> None:
    """Fail early unless every expert shares the base's architecture, shapes and vocabulary.

    Compared: ``architectures``, ``model_type``, ``hidden_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``,
    ``tie_word_embeddings`` from ``config.json``, and the tokenizer vocabularies (token -> id).
    Vocabulary padding differences are not silently aligned: with ``vocab_alignment="error"`` they
    are reported with the fix; with ``"base"`` an expert whose tokenizer equals the base's plus
    tokens appended after it (e.g. a ``[PAD]`` added for fine-tuning, as WizardMath's) is accepted,
    the merge keeps the base's vocabulary (mergekit ``tokenizer_source: base``) and the expert's
    extra output rows are ignored in the diagnostics. Anything else still fails.

    Raises:
        PoolMismatchError: naming the expert, the field, and both values.
        FileNotFoundError / ValueError: a checkpoint dir without config or weights, or corrupt weights.
    """
    from transformers import AutoTokenizer

    from darts_bench.evaluate.hf_model import check_checkpoint

    for p in (base, *experts.values()):
        check_checkpoint(p)
    keys = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")
    bcfg = _read_json(Path(base) / "config.json")
    btok = AutoTokenizer.from_pretrained(str(base)).get_vocab()
    for name, path in experts.items():
        ecfg = _read_json(Path(path) / "config.json")
        etok = AutoTokenizer.from_pretrained(str(path)).get_vocab()
        appended = _appended_tokens(btok, etok)
        aligned = vocab_alignment == "base" and appended is not None
        for k in keys:
            if k == "vocab_size" and aligned and ecfg.get(k, 0) >= bcfg.get(k, 0):
                continue
            if bcfg.get(k) != ecfg.get(k):
                hint = ""
                if k == "vocab_size":
                    hint = (" (embedding rows differ: re-save the expert with the base's padded vocabulary, "
                            "or set pool.vocab_alignment: base if the expert only appends tokens to the "
                            "base's; darts-bench does not align vocabularies silently)")
                raise PoolMismatchError(
                    f"expert {name!r} ({path}) does not match the base ({base}): {k} = "
                    f"{ecfg.get(k)!r} vs base {bcfg.get(k)!r}{hint}")
        if aligned and appended:
            log.warning("expert %r appends %d token(s) to the base vocabulary %s; merging on the base "
                        "vocabulary (pool.vocab_alignment: base)", name, len(appended), appended[:5])
        elif etok != btok:
            diff = sorted(set(etok.items()) ^ set(btok.items()))[:3]
            raise PoolMismatchError(
                f"expert {name!r} ({path}) has a different tokenizer vocabulary from the base ({base}): "
                f"{len(etok)} vs {len(btok)} tokens, first differences {diff}")


def _appended_tokens(base_vocab: dict[str, int], expert_vocab: dict[str, int]) -> list[str] | None:
    """Tokens the expert appends after the base's ids, or None if it changes any base token's id."""
    if any(expert_vocab.get(t) != i for t, i in base_vocab.items()):
        return None
    n = len(base_vocab)
    extra = sorted((i, t) for t, i in expert_vocab.items() if t not in base_vocab)
    if any(i < n for i, _ in extra):
        return None
    return [t for _, t in extra]


def pool_config_key(pc) -> dict:
    """``pool`` config as it enters a built pool's key: ``tiny.architecture`` is left out at its
    default (``llama``), so the Llama tiny pools built before the field existed keep their keys, and
    ``architecture`` (the planner's, :class:`~darts_bench.config.PlanArchitecture`) always."""
    d = pc.model_dump(mode="json")
    d.pop("architecture", None)  # the planner's hint (pool.architecture), not the pool's content
    if d["tiny"].get("architecture") == "llama":
        del d["tiny"]["architecture"]
    return d


def hf_pool_key(members: dict[str, str], names: tuple[str, ...] | list[str], vocab_alignment: str) -> str:
    """Key of an ``hf`` pool: its models' content keys (``members``: ``base`` and each expert),
    ``pool.vocab_alignment`` and the experts' order (``names``: the order merges take them in, which
    their rounding depends on), the order left out when it is :data:`EXPERT_NAMES`' so the pools
    keyed before experts had free names keep their keys."""
    key: dict = {"members": members, "vocab_alignment": vocab_alignment}
    if tuple(names) != EXPERT_NAMES:
        key["experts"] = list(names)
    return stable_hash(key)


def build_pool(cfg: Config, work_dir: Path) -> Pool:
    """Build (or reuse) the configured pool and check it.

    The pool key covers the pool's content: for ``hf`` the sha256 of every checkpoint file
    (weights, safetensors index, config, tokenizer; :mod:`darts_bench.pool.hashing`, remembered by
    size + mtime in ``<work_dir>/pool/hash-memo.json``), the hub revision of hub snapshots,
    ``pool.dtype``, ``pool.vocab_alignment`` and the experts' names and order (:func:`hf_pool_key`);
    for built pools their config (:func:`pool_config_key`) and training data. An ``hf`` pool has
    the experts of ``pool.experts`` (any names, in the order listed); a built pool the three of
    :data:`EXPERT_NAMES`.
    ``report["weights"]`` holds each model's file hashes (written to the results manifest).

    Raises:
        DataError: training data missing; PoolMismatchError: incompatible experts.
    """
    pc = cfg.pool
    data_dir = cfg.resolved_data_dir()
    if pc.kind == "hf":
        from darts_bench.pool.hub import resolve_model

        # hub ids -> local snapshot dirs, once: every later stage gets the local paths
        names = pc.expert_names
        sources = {"base": pc.base, **{e: pc.experts[e] for e in names}}
        resolved = {n: resolve_model(ref) for n, ref in sources.items()}
        experts = {e: resolved[e][0] for e in names}
        check_compatible(resolved["base"][0], experts, pc.vocab_alignment)
        # the key hashes the checkpoints' content (and the snapshot revision), not the ids or paths
        fps = pool_fingerprints({n: p for n, (p, _) in resolved.items()}, work_dir)
        members = {n: stable_hash({"weights": fp["key"], "dtype": pc.dtype}) for n, fp in fps.items()}
        report = {"sources": {n: {"id": str(sources[n]), "path": str(p), "revision": rev}
                              for n, (p, rev) in resolved.items()},
                  "weights": fps}
        return Pool(base=resolved["base"][0], experts=experts, key=hf_pool_key(members, names, pc.vocab_alignment),
                    report=report, members=members)
    key = stable_hash({"pool": pool_config_key(pc), "data": data_fingerprint(data_dir)})
    root = work_dir / "pool" / f"{pc.kind}-{key}"
    if pc.kind == "tiny":
        from darts_bench.pool.tiny import build_tiny_pool

        cached(root, lambda tmp: build_tiny_pool(pc, data_dir, tmp), what="pool (tiny)",
               meta={"kind": "pool", "config": pc.model_dump(mode="json")})
    else:
        from darts_bench.pool.gguf import build_gguf_pool

        cached(root, lambda tmp: build_gguf_pool(cfg, data_dir, tmp, work_dir), what=f"pool ({pc.kind})",
               meta={"kind": "pool", "config": pc.model_dump(mode="json")})
    report = json.loads((root / "build_report.json").read_text())
    report["weights"] = pool_fingerprints({"base": root / "base", **{e: root / e for e in EXPERT_NAMES}}, work_dir)
    pool = Pool(base=root / "base", experts={e: root / e for e in EXPERT_NAMES}, key=key, report=report)
    check_compatible(pool.base, pool.experts, pc.vocab_alignment)
    return pool
