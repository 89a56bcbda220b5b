"""A rehearsal pool for the ``mergebench-llama3.2-3b`` preset: MergeBench's Llama-3.2-3B pool in shape, not size.

What can break on the real pool (``meta-llama/Llama-3.2-3B`` and MergeBench's ``instruction``, ``math``,
``coding`` experts) is its shape, which this pool has, built in a few seconds on a CPU:

* the Llama-3 architecture as ``meta-llama/Llama-3.2-3B``'s ``config.json`` writes it: ``LlamaForCausalLM``,
  tied input / output embeddings (no ``lm_head.weight`` in the checkpoint), grouped-query attention
  (3 query heads per key/value head, as its 24 / 8), ``rope_theta`` 500,000 with ``rope_scaling``
  ``{"rope_type": "llama3", "factor": 32, ...}`` and 131,072 positions, a 128,256-row vocabulary;
* at reduced width (:data:`SHAPE`: 96-wide, 2 layers, head dim 32, the smallest vLLM's CPU attention
  takes) so the whole pool is about 100 MB;
* a tokenizer with 128,256 entries: a byte-level BPE trained here on the expert data
  (:data:`N_TRAINED` tokens) plus ``<|reserved_special_token_N|>`` entries up to the full vocabulary
  (Llama 3 reserves 256 such tokens; here most of the vocabulary), which no merge produces, so encoding
  never yields them; their embedding rows are zero, so their logits are exactly 0;
* weights seeded random (a base and three experts = base + a seeded task vector each: not trained;
  the rehearsal checks the path, not the numbers), saved in bfloat16 by ``save_pretrained`` in several
  ``model-0000k-of-0000n.safetensors`` shards with ``model.safetensors.index.json``;
* laid out in a Hugging Face hub cache under MergeBench's hub ids (:data:`REPO_IDS`,
  :func:`darts_bench.pool.rehearsal.layout_hub_cache`), so ``HF_HUB_OFFLINE=1`` resolution through
  ``huggingface_hub`` is the path that runs, as for the real pool.

From the command line::

    python -m darts_bench.pool.rehearsal_llama3 --hf-home work/mergebench-hf
    HF_HOME=work/mergebench-hf HF_HUB_OFFLINE=1 darts-bench run --config mergebench-llama3.2-3b --set device=cpu \\
        --set executor=local --set deepspeed.enabled=false --limit 2 ...
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from darts_bench.pool.rehearsal import layout_hub_cache

log = logging.getLogger("darts_bench")

#: pool entry -> MergeBench's hub id (tanganke/fusion_bench config/modelpool/CausalLMPool/mergebench/Llama-3.2-3B.yaml)
REPO_IDS = {
    "base": "meta-llama/Llama-3.2-3B",
    "instruction": "MergeBench/Llama-3.2-3B_instruction",
    "math": "MergeBench/Llama-3.2-3B_math",
    "coding": "MergeBench/Llama-3.2-3B_coding",
}
#: meta-llama/Llama-3.2-3B's rope settings (config.json)
ROPE_THETA = 500000.0
ROPE_SCALING = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
#: the reduced-width Llama-3 shape: Llama-3.2-3B's vocabulary, tying, GQA ratio and positions; tiny width
SHAPE = {"vocab_size": 128256, "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 3, "num_key_value_heads": 1, "max_position_embeddings": 131072,
         "tie_word_embeddings": True}
#: tokens of the BPE trained on the expert data; the rest of the vocabulary is reserved entries
N_TRAINED = 768
#: standard deviation of each expert's seeded task vector (the base's weights are initialised at 0.02)
TASK_VECTOR_STD = 0.005


def llama3_tokenizer(data_dir: Path | None, seed: int = 0):
    """A byte-level BPE of :data:`N_TRAINED` tokens trained on the three expert-training sets (400
    examples each), padded to :data:`SHAPE` ``vocab_size`` entries with ``<|reserved_special_token_N|>``
    vocabulary entries that no merge reaches (never produced by encoding). A ``PreTrainedTokenizerFast``
    with the tiny pool's eos / pad / chat template.

    Raises:
        DataError: an expert-training file missing or malformed.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from darts_bench.config import EXPERT_NAMES
    from darts_bench.data import EXPERT_DATA, load_expert_records
    from darts_bench.pool.tiny import CHAT_TEMPLATE, EOS, PAD, train_tokenizer
    from darts_bench.pool.training import alpaca_chat, expert_texts, sample_records

    texts = [d for e in EXPERT_NAMES
             for d in expert_texts(sample_records(load_expert_records(data_dir, e), 400, seed), EXPERT_DATA[e][1],
                                   EOS, alpaca_chat)]
    small = train_tokenizer(texts, N_TRAINED)
    spec = json.loads(small.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    if len(vocab) > N_TRAINED:
        raise ValueError(f"trained BPE has {len(vocab)} tokens, more than {N_TRAINED}")
    n = len(vocab)
    for i in range(SHAPE["vocab_size"] - n):
        vocab[f"<|reserved_special_token_{i}|>"] = n + i
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=EOS,
                                  bos_token=EOS, pad_token=PAD, unk_token=None, padding_side="left",
                                  model_max_length=SHAPE["max_position_embeddings"])
    tok.chat_template = CHAT_TEMPLATE
    if len(tok) != SHAPE["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tok)} entries, expected {SHAPE['vocab_size']}")
    return tok, n


def _write_checkpoint(model, tok, out: Path, max_shard_size: str) -> Path:
    """``save_pretrained`` in bfloat16 shards, then ``config.json`` in the hub's form (``rope_scaling`` +
    ``rope_theta``, as meta-llama/Llama-3.2-3B's; transformers 5 writes ``rope_parameters``, which
    transformers 4 and the engines built on it do not read)."""
    model.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    tok.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("rope_parameters", None)
    cfg.update({"rope_theta": ROPE_THETA, "rope_scaling": dict(ROPE_SCALING)})
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    index = out / "model.safetensors.index.json"
    if not index.is_file() or len(set(json.loads(index.read_text())["weight_map"].values())) < 3:
        raise ValueError(f"{out}: expected at least 3 shards and an index; lower max_shard_size")
    if "lm_head.weight" in json.loads(index.read_text())["weight_map"]:
        raise ValueError(f"{out}: lm_head.weight saved: the embeddings are not tied")
    return out


def build_llama3_checkpoints(data_dir: Path | None, out: Path | str, seed: int = 0,
                             max_shard_size: str = "200KB") -> dict[str, Path]:
    """The base and the three experts (:data:`REPO_IDS` entries) as checkpoint dirs under ``out``.

    The base is ``LlamaForCausalLM`` of :data:`SHAPE` with Llama-3.2-3B's rope settings, initialised
    from ``seed``, the embedding rows of the reserved tokens zeroed; each expert adds a seeded
    Gaussian task vector (:data:`TASK_VECTOR_STD`) to every weight but those rows; all in bfloat16.

    Returns:
        entry -> checkpoint dir.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out)
    tok, n_trained = llama3_tokenizer(data_dir, seed)
    mcfg = LlamaConfig(**SHAPE, rope_theta=ROPE_THETA, rope_scaling=dict(ROPE_SCALING), bos_token_id=tok.eos_token_id,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    base = LlamaForCausalLM(mcfg).eval()
    with torch.no_grad():
        base.get_input_embeddings().weight[n_trained:].zero_()
    base.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                              bos_token_id=tok.eos_token_id, do_sample=False)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    dirs = {}
    for i, name in enumerate(REPO_IDS):
        model = base
        if name != "base":
            g = torch.Generator().manual_seed(seed * 1000 + i)
            with torch.no_grad():
                for k, p in base.named_parameters():
                    delta = torch.randn(p.shape, generator=g) * TASK_VECTOR_STD
                    if k == "model.embed_tokens.weight":
                        delta[n_trained:] = 0
                    p.copy_(state[k] + delta)
        dirs[name] = _write_checkpoint(model.to(torch.bfloat16), tok, out / name, max_shard_size)
        base.to(torch.float32).load_state_dict(state)
    return dirs


def build_llama3_rehearsal_hub(data_dir: Path | None, cache: Path | str, seed: int = 0) -> dict[str, str]:
    """Build the pool (:func:`build_llama3_checkpoints`) and lay it out in the hub cache ``cache``
    under :data:`REPO_IDS`.

    Returns:
        entry -> revision.
    """
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".rehearsal-llama3-") as d:
        dirs = build_llama3_checkpoints(data_dir, Path(d), seed)
        return {name: layout_hub_cache(dirs[name], cache, repo)[1] for name, repo in REPO_IDS.items()}


def main(argv: list[str] | None = None) -> int:
    """``python -m darts_bench.pool.rehearsal_llama3 --hf-home DIR``: lay the pool out in ``DIR/hub``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-home", required=True, help="HF_HOME to lay the pool out in (the hub cache is DIR/hub)")
    ap.add_argument("--data-dir", default=None, help="expert training data for the tokenizer (default $DARTS_BENCH_DATA)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from darts_bench.config import Config

    data_dir = Config.model_validate({"data_dir": args.data_dir}).resolved_data_dir()
    revs = build_llama3_rehearsal_hub(data_dir, Path(args.hf_home) / "hub")
    for name, rev in revs.items():
        print(f"{REPO_IDS[name]} @ {rev}")
    print(f"\nrun: HF_HOME={args.hf_home} HF_HUB_OFFLINE=1 darts-bench run --config mergebench-llama3.2-3b --set device=cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
