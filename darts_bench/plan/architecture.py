"""The pool's architecture for the plan, from the config alone (no model is loaded, the hub is never
contacted), and the parameter counts derived from it.

Where it comes from, first match wins: ``pool.tiny`` for the tiny tier; ``config.json`` of a local
model dir, or of a hub id whose snapshot is in the local hub cache (``HF_HOME`` / ``HF_HUB_CACHE``;
looked up with ``huggingface_hub.try_to_load_from_cache``, never fetched); ``pool.architecture`` (a
name in :data:`KNOWN_ARCHITECTURES` or the numbers, :class:`~darts_bench.config.PlanArchitecture`);
else :data:`KNOWN_ARCHITECTURES`, matched on the model id (SmolLM2-135M, Llama-2-7B, Llama-3.2-3B).

An architecture is a dict with the ``config.json`` keys ``hidden_size``, ``num_hidden_layers``,
``vocab_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads`` (ints),
``tie_word_embeddings`` (bool) and ``max_position_embeddings`` (int or None).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from darts_bench.config import (DTYPE_BYTES, KNOWN_ARCHITECTURES, MERGEKIT_OUT_SHARD_BYTES, MIN_OUT_SHARD_BYTES,  # noqa: F401
                                 OUT_SHARDS, Config, out_shard_bytes)

_ARCH_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "tie_word_embeddings")


def _known(name: str | None) -> str | None:
    n = (name or "").lower().replace("_", "-")
    if "smollm2" in n and "135m" in n:
        return "smollm2-135m"
    if "llama-2-7b" in n or "llama2-7b" in n:
        return "llama-2-7b"
    if "llama-3.2-3b" in n or "llama3.2-3b" in n:
        return "llama-3.2-3b"
    return None


def _cached_config(ref: str) -> Path | None:
    """``config.json`` of the hub id ``ref`` (``org/name[@revision]``) when the local hub cache
    holds it (``huggingface_hub.try_to_load_from_cache``: a file lookup, the hub is never
    contacted), else None."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    from darts_bench.pool.hub import hub_cache_dir, split_revision

    repo, rev = split_revision(ref)
    try:
        got = try_to_load_from_cache(repo, "config.json", cache_dir=hub_cache_dir(), revision=rev)
    except (HFValidationError, ValueError):  # not a hub id
        return None
    return Path(got) if isinstance(got, str) else None


def _config_file(path: str | None) -> Path | None:
    """``config.json`` of a local checkpoint dir or of a hub id in the local hub cache."""
    if not path:
        return None
    p = Path(path).expanduser()
    if p.exists():
        return p / "config.json" if (p / "config.json").is_file() else None
    return _cached_config(str(path))


def _from_dir(path: str | None) -> dict[str, Any] | None:
    f = _config_file(path)
    if f is None:
        return None
    raw = json.loads(f.read_text())
    raw = raw.get("text_config", raw)
    if not all(k in raw for k in _ARCH_KEYS[:5]):
        return None
    arch = {k: raw.get(k) for k in _ARCH_KEYS}
    arch["num_key_value_heads"] = arch["num_key_value_heads"] or arch["num_attention_heads"]
    arch["tie_word_embeddings"] = bool(arch["tie_word_embeddings"])
    arch["max_position_embeddings"] = raw.get("max_position_embeddings")
    return arch


def architecture(cfg: Config) -> tuple[dict[str, Any] | None, str]:
    """``(arch, source)``: the pool's architecture (see the module docstring; None if unknown) and a
    sentence saying where it came from (``pool.tiny``, a ``config.json`` path, ``pool.architecture``,
    a known model id)."""
    pool = cfg.pool
    if pool.kind == "tiny":
        t = pool.tiny
        return ({"hidden_size": t.hidden_size, "num_hidden_layers": t.num_hidden_layers, "vocab_size": t.vocab_size,
                 "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_attention_heads,
                 "num_key_value_heads": t.num_key_value_heads,
                 "tie_word_embeddings": t.architecture == "qwen2",
                 "max_position_embeddings": t.max_position_embeddings}, "pool.tiny")
    arch = _from_dir(pool.base)
    if arch:
        return arch, str(_config_file(pool.base))
    given = pool.architecture
    if isinstance(given, str):
        return dict(KNOWN_ARCHITECTURES[given]), f"pool.architecture {given} (known architecture)"
    if given is not None:
        arch = given.model_dump(mode="json")
        arch["num_key_value_heads"] = arch["num_key_value_heads"] or arch["num_attention_heads"]
        return arch, "pool.architecture (given in the config)"
    for cand in (pool.base, pool.gguf_file if pool.kind == "gguf" else None,
                 pool.gguf_wheel if pool.kind == "gguf" else None, cfg.name):
        k = _known(cand)
        if k:
            return dict(KNOWN_ARCHITECTURES[k]), f"known architecture {k} (from {cand!r})"
    return None, ("unknown (no local config.json, no pool.architecture and not a known model id; set "
                  f"pool.architecture to one of {sorted(KNOWN_ARCHITECTURES)} or to the base's config.json numbers)")


def param_count(arch: dict[str, Any]) -> dict[str, int]:
    """Parameters of a Llama-style decoder of ``arch``: ``{"total", "largest_tensor"}`` (counts of
    elements; q, o, k, v, gate, up, down and two norms per layer, embeddings once when tied)."""
    d, L, V, I = arch["hidden_size"], arch["num_hidden_layers"], arch["vocab_size"], arch["intermediate_size"]
    kv = d // arch["num_attention_heads"] * arch["num_key_value_heads"]
    layer = 2 * d * d + 2 * d * kv + 3 * d * I + 2 * d  # q, o; k, v; gate, up, down; two norms
    embed = V * d
    total = embed * (1 if arch["tie_word_embeddings"] else 2) + L * layer + d
    return {"total": total, "largest_tensor": max(embed, d * I, d * d)}


def kv_dim(arch: dict[str, Any]) -> int:
    """Width of one layer's K (or V) per token: head dim x KV heads."""
    return arch["hidden_size"] // arch["num_attention_heads"] * arch["num_key_value_heads"]


def activations(arch: dict[str, Any], batch: int, seq: int, dtype_b: int) -> int:
    """Bytes of one forward's working set over ``[batch, seq]`` tokens in a ``dtype_b``-byte dtype:
    the logits with the float32 log-softmax and probabilities of the entropy, one layer's eager
    attention scores and one layer's MLP working set (no gradients kept)."""
    d, V, I, H = arch["hidden_size"], arch["vocab_size"], arch["intermediate_size"], arch["num_attention_heads"]
    logits = batch * seq * V * (dtype_b + 8)  # logits + fp32 log-softmax and probs for the entropy
    attn = batch * H * seq * seq * dtype_b  # eager attention scores of one layer
    mlp = batch * seq * (3 * I + 4 * d) * dtype_b  # one layer's working set (no grad kept)
    return logits + attn + mlp


def kv_cache(arch: dict[str, Any], batch: int, seq: int, dtype_b: int) -> int:
    """Bytes of the K and V cache of all layers for ``[batch, seq]`` tokens in a ``dtype_b``-byte dtype."""
    return 2 * arch["num_hidden_layers"] * batch * seq * kv_dim(arch) * dtype_b
