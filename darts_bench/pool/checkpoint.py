"""Reading single tensors out of a (possibly sharded) safetensors checkpoint dir, lazily.

Hugging Face ``save_pretrained`` writes a checkpoint either as one ``model.safetensors`` or, when
it is larger than ``max_shard_size``, as ``model-0000k-of-0000n.safetensors`` shards plus
``model.safetensors.index.json`` whose ``weight_map`` names the shard holding each tensor
(the format of the 7B hub checkpoints). A tensor is read from the shard the index names, never
by scanning shards for a similar name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def tensor_file(model_dir: Path | str, name: str) -> Path:
    """The safetensors file of ``model_dir`` that stores tensor ``name``.

    Uses ``model.safetensors.index.json`` (``weight_map``) when present, else the single
    ``model.safetensors`` (or the only ``*.safetensors`` file).

    Raises:
        FileNotFoundError: no safetensors weights, or the index names a shard that is missing.
        KeyError: ``name`` is not in the checkpoint (the message lists what is).
    """
    d = Path(model_dir)
    index = d / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        if name not in weight_map:
            raise KeyError(f"tensor {name!r} not in {index} (weight_map has {len(weight_map)} tensors, "
                           f"e.g. {sorted(weight_map)[:4]})")
        f = d / weight_map[name]
        if not f.is_file():
            raise FileNotFoundError(f"{index} maps {name!r} to {weight_map[name]}, which is missing")
        return f
    files = [d / SINGLE_NAME] if (d / SINGLE_NAME).is_file() else sorted(d.glob("*.safetensors"))
    if len(files) != 1:
        raise FileNotFoundError(f"{d}: expected {INDEX_NAME} or a single *.safetensors file, found "
                                f"{[f.name for f in files]}")
    with safe_open(str(files[0]), "pt") as st:
        if name not in st.keys():
            raise KeyError(f"tensor {name!r} not in {files[0]} (has {sorted(st.keys())[:4]} ...)")
    return files[0]


def check_safetensors_length(f: Path | str) -> None:
    """Raises ValueError when safetensors file ``f`` is not exactly as long as its header says (truncated
    by an interrupted copy, or padded)."""
    size = Path(f).stat().st_size
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(f"expected {8 + n + end} bytes, found {size}")


def read_tensor(model_dir: Path | str, name: str) -> torch.Tensor:
    """Tensor ``name`` of the checkpoint in ``model_dir`` in its stored dtype (only that tensor is read)."""
    with safe_open(str(tensor_file(model_dir, name)), "pt") as st:
        return st.get_tensor(name)


def ties_word_embeddings(model_dir: Path | str) -> bool:
    """Whether the checkpoint's output matrix is its input embedding (``tie_word_embeddings``),
    with the model class's default when ``config.json`` does not say (read by ``AutoConfig``)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    tied = getattr(cfg, "tie_word_embeddings", None)
    if tied is None and hasattr(cfg, "get_text_config"):
        tied = getattr(cfg.get_text_config(), "tie_word_embeddings", None)
    return bool(tied)


def lm_head_weight(model_dir: Path | str) -> torch.Tensor:
    """The output matrix ``[vocab, d_model]`` (float32) of a causal LM checkpoint dir.

    ``lm_head.weight`` for an untied model; ``model.embed_tokens.weight`` only when the config
    ties word embeddings. Sharded checkpoints are read through the index's ``weight_map``.

    Raises:
        FileNotFoundError / KeyError: the checkpoint has no such tensor (an untied model without
        ``lm_head.weight`` is an error, not a reason to fall back to the embedding).
    """
    name = "model.embed_tokens.weight" if ties_word_embeddings(model_dir) else "lm_head.weight"
    return read_tensor(model_dir, name).float()
