"""Pool construction, caching and the compatibility checks run before any merge."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from darts_bench.artifacts import cached, file_sha256, stable_hash
from darts_bench.config import EXPERT_NAMES, Config
from darts_bench.data import EXPERT_DATA, require_file

log = logging.getLogger("darts_bench")


class PoolMismatchError(ValueError):
    """Experts that cannot be merged with the base (architecture, size or vocabulary differ)."""


@dataclass(frozen=True)
class Pool:
    """Checkpoint dirs of the base and each expert, and the pool's cache key."""

    base: Path
    experts: dict[str, Path]
    key: str
    report: dict = field(default_factory=dict, compare=False)

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


def check_compatible(base: Path | str, experts: dict[str, Path | str]) -> None:
    """Fail early unless every expert shares the base's architecture, shapes and vocabulary.

    Compared: ``architectures``, ``model_type``, ``hidden_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``,
    ``tie_word_embeddings`` from ``config.json``, and the tokenizer vocabularies (token -> id).
    Vocabulary padding differences are not silently aligned: they are reported with the fix.

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
        for k in keys:
            if bcfg.get(k) != ecfg.get(k):
                hint = ""
                if k == "vocab_size":
                    hint = (" (embedding rows differ: re-save the expert with the base's padded vocabulary, "
                            "or resize both to one size; darts-bench does not align vocabularies silently)")
                raise PoolMismatchError(
                    f"expert {name!r} ({path}) does not match the base ({base}): {k} = "
                    f"{ecfg.get(k)!r} vs base {bcfg.get(k)!r}{hint}")
        etok = AutoTokenizer.from_pretrained(str(path)).get_vocab()
        if etok != btok:
            diff = sorted(set(etok.items()) ^ set(btok.items()))[:3]
            raise PoolMismatchError(
                f"expert {name!r} ({path}) has a different tokenizer vocabulary from the base ({base}): "
                f"{len(etok)} vs {len(btok)} tokens, first differences {diff}")


def build_pool(cfg: Config, work_dir: Path) -> Pool:
    """Build (or reuse) the configured pool and check it.

    Raises:
        DataError: training data missing; PoolMismatchError: incompatible experts.
    """
    pc = cfg.pool
    data_dir = cfg.resolved_data_dir()
    if pc.kind == "hf":
        experts = {e: Path(pc.experts[e]) if Path(pc.experts[e]).exists() else pc.experts[e]
                   for e in EXPERT_NAMES}
        check_compatible(pc.base, experts)
        return Pool(base=Path(pc.base), experts={e: Path(p) for e, p in experts.items()},
                    key=stable_hash([pc.base, pc.experts]))
    key = stable_hash({"pool": pc.model_dump(mode="json"), "data": data_fingerprint(data_dir)})
    root = work_dir / "pool" / f"{pc.kind}-{key}"
    if pc.kind == "tiny":
        from darts_bench.pool.tiny import build_tiny_pool

        cached(root, lambda tmp: build_tiny_pool(pc, data_dir, tmp), what="pool (tiny)",
               meta={"kind": "pool", "config": pc.model_dump(mode="json")})
    else:
        from darts_bench.pool.gguf import build_gguf_pool

        cached(root, lambda tmp: build_gguf_pool(cfg, data_dir, tmp, work_dir), what=f"pool ({pc.kind})",
               meta={"kind": "pool", "config": pc.model_dump(mode="json")})
    pool = Pool(base=root / "base", experts={e: root / e for e in EXPERT_NAMES}, key=key,
                report=json.loads((root / "build_report.json").read_text()))
    check_compatible(pool.base, pool.experts)
    return pool
