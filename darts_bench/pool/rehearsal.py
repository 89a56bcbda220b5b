"""A rehearsal pool for the ``llama2-7b`` path: every property of the paper's pool except its size.

The paper's pool (Llama-2-7B + three hub fine-tunes) is big; what can break on it is not the size
but its shape. The rehearsal pool has that shape, built in seconds from a small pool (by default
a ``tiny`` pool trained here):

* saved by ``save_pretrained`` with a small ``max_shard_size``: every model is several
  ``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``, with the
  embedding in the first shard and ``lm_head.weight`` in a later one (as HF-saved 7B checkpoints);
* untied ``lm_head`` (``tie_word_embeddings: false``), weights in bfloat16;
* the ``math`` expert appends a ``[PAD]`` token (vocab + 1, its pad token), as WizardMath-7B-V1.0
  does, so ``pool.vocab_alignment: base`` is exercised;
* ``max_position_embeddings`` raised (rotary positions: no weights change) so prompts and
  sequences cross 1,024 positions, as 5-shot GSM8K does on Llama-2;
* laid out in a Hugging Face hub cache (``<cache>/models--org--name/{blobs,snapshots/<rev>,refs/main}``,
  snapshot files symlinked to content-addressed blobs, as ``huggingface_hub`` writes them) and
  referenced by hub ids (:data:`REPO_IDS`), so ``HF_HUB_OFFLINE=1`` resolution through
  ``huggingface_hub.snapshot_download`` is the code path that runs.

``darts_bench/configs/llama2-7b-rehearsal.yaml`` names these ids. From the command line::

    python -m darts_bench.pool.rehearsal --hf-home work/rehearsal-hf   # builds + lays out the pool
    HF_HOME=work/rehearsal-hf HF_HUB_OFFLINE=1 darts-bench run --config llama2-7b-rehearsal
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("darts_bench")

# pool entry -> the hub id the rehearsal config uses (shaped after the llama2-7b config's ids)
REPO_IDS = {
    "base": "darts-rehearsal/Llama-2-7b-hf",
    "code": "darts-rehearsal/Llama-2-7b-evolcodealpaca",
    "math": "darts-rehearsal/WizardMath-7B-V1.0",
    "instruction": "darts-rehearsal/vicuna-7b-v1.5",
}
APPENDS_PAD = ("math",)  # experts that append a [PAD] token (vocab + 1)
MAX_POSITION_EMBEDDINGS = 4096  # Llama-2's
# The source tiny pool the command line builds (the test suite's micro pool settings: seconds).
SOURCE_TINY = {"pretrain_steps": 60, "finetune_steps": 40, "max_train_examples": 400,
               "tokenizer_train_examples": 400, "vocab_size": 768, "hidden_size": 48,
               "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "seq_len": 64, "batch_size": 8, "pretrain_lr": 5e-3,
               "finetune_lr": 2e-3}


def convert_checkpoint(src: Path | str, out: Path | str, *, append_pad: bool = False,
                       max_shard_size: str = "40KB", dtype: str = "bfloat16",
                       max_position_embeddings: int = MAX_POSITION_EMBEDDINGS) -> Path:
    """Re-save the HF checkpoint ``src`` into ``out`` in the 7B hub layout (see the module docstring).

    Args:
        append_pad: add a ``[PAD]`` token as the pad token and grow the embedding and ``lm_head``
            by one row (``resize_token_embeddings``), as WizardMath-7B-V1.0.
        max_shard_size: ``save_pretrained``'s shard size; small enough for several shards.
    Returns:
        ``out``.
    Raises:
        ValueError: the result is not sharded with an index, or its ``lm_head`` is tied.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    if model.config.tie_word_embeddings:
        raise ValueError(f"{src}: tied word embeddings; the rehearsal pool needs an untied lm_head")
    if append_pad:
        tok.add_special_tokens({"pad_token": "[PAD]"})
        model.resize_token_embeddings(len(tok), mean_resizing=False)
        with torch.no_grad():  # a deterministic new row (resize initialises it randomly)
            model.get_input_embeddings().weight[-1].zero_()
            model.get_output_embeddings().weight[-1].zero_()
        model.config.pad_token_id = tok.pad_token_id
        if model.generation_config is not None:
            model.generation_config.pad_token_id = tok.pad_token_id
    model.config.max_position_embeddings = max_position_embeddings
    model = model.to(getattr(torch, dtype))
    # module order (embedding in the first shard, lm_head in the last), as in the 7B hub checkpoints
    # written by transformers 4; transformers 5 sorts the keys when it reverts weight conversions
    # (none for Llama), which would put lm_head first
    model.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True, save_original_format=False)
    tok.model_max_length = max_position_embeddings
    tok.save_pretrained(out)
    index = out / "model.safetensors.index.json"
    if not index.is_file() or len(set(json.loads(index.read_text())["weight_map"].values())) < 3:
        raise ValueError(f"{out}: expected at least 3 shards and an index; lower max_shard_size")
    wm = json.loads(index.read_text())["weight_map"]
    if not wm["model.embed_tokens.weight"] < wm["lm_head.weight"]:
        raise ValueError(f"{out}: lm_head.weight is not in a later shard than the embedding ({wm['lm_head.weight']})")
    return out


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def layout_hub_cache(snapshot: Path | str, cache: Path | str, repo_id: str) -> tuple[Path, str]:
    """Place the files of ``snapshot`` in the hub cache ``cache`` as ``huggingface_hub`` does:
    ``models--<org>--<name>/blobs/<sha256>``, ``snapshots/<revision>/<file>`` (relative symlinks to
    the blobs) and ``refs/main`` holding the revision. The revision is a 40-hex digest of the
    files (a stand-in for the repo's commit hash).

    Returns:
        ``(snapshot_dir, revision)``.
    """
    snapshot, cache = Path(snapshot), Path(cache)
    files = sorted(p for p in snapshot.rglob("*") if p.is_file())
    digests = {p.relative_to(snapshot).as_posix(): _sha256(p) for p in files}
    revision = hashlib.sha1(json.dumps(digests, sort_keys=True).encode()).hexdigest()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snap_dir = repo_dir / "snapshots" / revision
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    for rel, digest in digests.items():
        blob = repo_dir / "blobs" / digest
        if not blob.exists():
            tmp = blob.with_name(blob.name + ".incomplete")
            shutil.copyfile(snapshot / rel, tmp)
            tmp.replace(blob)
        link = snap_dir / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    tmp_ref = repo_dir / "refs" / ".main.tmp"
    tmp_ref.write_text(revision)
    tmp_ref.replace(repo_dir / "refs" / "main")
    return snap_dir, revision


def build_rehearsal_hub(source: dict[str, Path], cache: Path | str, max_shard_size: str = "40KB") -> dict[str, str]:
    """Convert the pool ``source`` (``base``, ``code``, ``math``, ``instruction`` checkpoint dirs) and
    lay it out in the hub cache ``cache`` under :data:`REPO_IDS`.

    Returns:
        entry -> revision.
    """
    revisions = {}
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".rehearsal-") as d:
        for name, repo_id in REPO_IDS.items():
            conv = convert_checkpoint(source[name], Path(d) / name, append_pad=name in APPENDS_PAD,
                                      max_shard_size=max_shard_size)
            revisions[name] = layout_hub_cache(conv, cache, repo_id)[1]
    return revisions


def main(argv: list[str] | None = None) -> int:
    """``python -m darts_bench.pool.rehearsal --hf-home DIR``: build a tiny source pool (cached in
    ``--work-dir``) and lay the rehearsal pool out in ``DIR/hub``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-home", required=True, help="HF_HOME to lay the pool out in (the hub cache is DIR/hub)")
    ap.add_argument("--work-dir", default="work", help="where the source tiny pool is built and cached")
    ap.add_argument("--data-dir", default=None, help="expert training data (default $DARTS_BENCH_DATA)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from darts_bench.config import Config
    from darts_bench.pool.build import build_pool

    cfg = Config.model_validate({"name": "rehearsal-source", "data_dir": args.data_dir, "torch_threads": 1,
                                 "pool": {"kind": "tiny", "tiny": SOURCE_TINY}})
    pool = build_pool(cfg, Path(args.work_dir))
    revs = build_rehearsal_hub({"base": pool.base, **pool.experts}, Path(args.hf_home) / "hub")
    for name, rev in revs.items():
        print(f"{REPO_IDS[name]} @ {rev}")
    print(f"\nrun: HF_HOME={args.hf_home} HF_HUB_OFFLINE=1 darts-bench run --config llama2-7b-rehearsal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
