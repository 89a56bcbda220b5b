"""Shared fixtures: the data dir, a micro config and a micro pool built in seconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("DARTS_BENCH_DATA", REPO.parent / "shared" / "data")).resolve()

MICRO = {
    "name": "micro",
    "torch_threads": 1,
    "data_dir": str(DATA_DIR),
    "pool": {"tiny": {"pretrain_steps": 60, "finetune_steps": 40, "max_train_examples": 400,
                      "tokenizer_train_examples": 400, "vocab_size": 768, "hidden_size": 48,
                      "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "seq_len": 64, "batch_size": 8, "pretrain_lr": 5e-3,
                      "finetune_lr": 2e-3}},
    "merges": [{"name": "ties", "method": "ties", "density": 0.5, "normalize": True},
               {"name": "task_arithmetic", "method": "task_arithmetic", "weight": 0.5}],
    "calibration": {"splits": ["transductive", "inductive"], "n_prompts": 6, "max_new_tokens": 8,
                    "batch_size": 4},
    "surgery": {"epochs": 30, "batch_size": 64},
    "tasks": {"batch_size": 4, "bootstrap": 50,
              "humaneval": {"limit": 4, "max_new_tokens": 12},
              "gsm8k": {"limit": 4, "max_new_tokens": 12},
              "alpacaeval": {"limit": 4, "max_new_tokens": 12}},
}


def micro_config_file(tmp: Path, **overrides) -> Path:
    cfg = yaml.safe_load(yaml.safe_dump(MICRO))
    cfg["work_dir"] = str(tmp / "work")
    cfg["out_dir"] = str(tmp / "results")
    for k, v in overrides.items():
        cfg[k] = v
    p = tmp / "micro.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA_DIR / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"data dir {DATA_DIR} not found (set DARTS_BENCH_DATA)")
    return DATA_DIR


@pytest.fixture(scope="session")
def micro_dir(tmp_path_factory, data_dir) -> Path:
    return tmp_path_factory.mktemp("micro")


@pytest.fixture(scope="session")
def micro_cfg_path(micro_dir) -> Path:
    return micro_config_file(micro_dir)


@pytest.fixture(scope="session")
def micro_pipeline(micro_cfg_path):
    """A Pipeline on the micro config, its pool and merges built once per session."""
    from darts_bench.config import load_config
    from darts_bench.pipeline import Pipeline

    pipe = Pipeline(load_config(str(micro_cfg_path)))
    pipe.merge()
    yield pipe
    pipe.close()
