"""Shared fixtures: the data dir, a micro config and a micro pool built in seconds."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Every Ray instance the tests start (the shared one below, and the few tests that start their own)
# keeps its session files in a private dir, not beside other Ray instances in /tmp/ray; short, as
# Ray's socket paths must fit in 107 bytes.
_RAY_TMP = tempfile.mkdtemp(prefix="dbt-ray-", dir="/tmp")
os.environ["RAY_TMPDIR"] = _RAY_TMP
# Load-tolerant start-up: on a loaded 2-core machine workers register slowly (defaults: 60 s).
os.environ.setdefault("RAY_worker_register_timeout_seconds", "600")
os.environ.setdefault("RAY_gcs_server_request_timeout_seconds", "300")

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


# The micro pool at vLLM-sized widths (64-wide layers, 2 query heads and 1 key/value head: head_dim 32,
# the smallest vLLM's CPU attention takes; grouped-query attention), one fine-tuning step per expert
VLLM_MICRO_TINY = {**MICRO["pool"]["tiny"], "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "max_position_embeddings": 256, "finetune_steps": 1}
# ... and its Qwen2 shape: q/k/v biases, tied input/output embeddings
QWEN2_MICRO_TINY = {**VLLM_MICRO_TINY, "architecture": "qwen2"}


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def micro_config_file(tmp: Path, **overrides) -> Path:
    cfg = yaml.safe_load(yaml.safe_dump(MICRO))
    cfg["work_dir"] = str(tmp / "work")
    cfg["out_dir"] = str(tmp / "results")
    for k, v in overrides.items():
        cfg[k] = v
    p = tmp / "micro.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def tiny_llama_and_tokenizer(prompts: list[str]):
    """A 32-wide, 2-layer random Llama (grouped-query attention, seed 0) and a 300-token BPE tokenizer
    trained on ``prompts``, padding on the left: the model the head-hook tests generate with."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from darts_bench.pool.tiny import train_tokenizer

    tok = train_tokenizer(list(prompts) * 30 + ["the quick brown fox jumps over the lazy dog"] * 30, 300)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    tok.padding_side = "left"
    return model, tok


def tiny_checkpoint_with_heads(tmp: Path, texts: list[str], seed: int) -> tuple[Path, list[str]]:
    """``tiny_llama_and_tokenizer(texts)`` saved to ``tmp/model``, and a Surgery and a DARTS head (rank 4, 8 bias
    positions, clamped beyond) with random ``up`` weights and position bias (torch seeds ``seed``, ``seed + 1``; an
    untrained head's ``up`` is zero) saved to ``tmp/head0``, ``tmp/head1``: the model dir and the head dirs."""
    import torch

    from darts_bench.surgery.heads import build_head, save_head

    model, tok = tiny_llama_and_tokenizer(texts)
    model.save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    dirs = []
    for i, method in enumerate(("surgery", "darts")):
        head = build_head(method, 32, rank=4, max_len=8, overflow="clamp", seed=i)
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            head.up.weight.copy_(torch.randn(head.up.weight.shape, generator=g))
            if head.pos_bias is not None:
                head.pos_bias.copy_(torch.randn(head.pos_bias.shape, generator=g))
        save_head(head, tmp / f"head{i}")
        dirs.append(str(tmp / f"head{i}"))
    return tmp / "model", dirs


class StandInEngine:
    """What ``VLLMTextModel`` / ``VLLMMultiHeadModel`` read of a ``VLLMEngine``, without vllm: the tokenizer, the
    HF copy (``scorer``) and ``scoring`` mode; a head swap fails the test, ``set_heads`` records the slots' dirs.
    The routing tests patch ``VLLMTextModel._engine_score`` for what would reach the engine."""

    max_position, llm = 64, None

    def __init__(self, tokenizer, scorer, scoring: str):
        self.tokenizer, self.scorer, self.scoring = tokenizer, scorer, scoring
        self.head_dirs: list[str] = []

    def set_head(self, _):
        raise AssertionError("no head swap")

    def set_heads(self, dirs):
        self.head_dirs = [str(d) if d else "" for d in dirs]


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """The root logger's handlers and level as they were before each test: a test that runs the CLI
    (``main([...])`` calls ``logging.basicConfig(force=True)``) leaves a handler on that test's
    captured stderr, which pytest closes; a later test's log record would hit the closed stream."""
    import logging

    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


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


# ------------------------------------------------------------------------------ Ray, shared
def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_left(pids: set[int], timeout: float = 20.0) -> set[int]:
    """Wait for ``pids`` to exit, SIGKILL (by pid) what is left, return the pids that were left."""
    import psutil

    deadline, alive = time.time() + timeout, set(pids)
    while alive and time.time() < deadline:
        time.sleep(0.25)
        alive = {p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


@pytest.fixture(scope="session")
def ray_instance():
    """One local Ray instance (loopback, 2 CPUs, session files in a private temp dir) shared by every
    test that asks for it; start-up is retried when Ray's fixed 30 s node start-up wait runs out
    on a loaded machine. Everything it started is stopped by pid at the end of the run."""
    ray = pytest.importorskip("ray")
    from darts_bench.ray_instance import init_ray

    if ray.is_initialized():
        pytest.skip("Ray already initialised in this process by a test that owns it")
    auth = os.environ.get("RAY_AUTH_MODE")
    before = _child_pids()
    temp = tempfile.mkdtemp(prefix="s-", dir=_RAY_TMP)
    for attempt in range(3):
        try:
            init_ray(None, num_cpus=2, temp_dir=temp)
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception on a start-up timeout
            ray.shutdown()
            _kill_left(_child_pids() - before, timeout=5)
            if "timed out" not in str(e).lower() or attempt == 2:
                raise
            time.sleep(5)
    started = _child_pids() - before
    yield ray
    started |= _child_pids() - before
    ray.shutdown()
    left = _kill_left(started)
    if auth is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = auth
    shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"Ray processes left after shutdown (killed): {left}"


def pytest_unconfigure(config):
    shutil.rmtree(_RAY_TMP, ignore_errors=True)


# ------------------------------------------------------------------------ the rehearsal pool
@pytest.fixture(scope="session")
def rehearsal_hub(micro_pipeline, tmp_path_factory) -> Path:
    """The 7B-shaped rehearsal pool (darts_bench/pool/rehearsal.py) converted from the micro pool
    and laid out in a hub cache; returns its HF_HOME (the cache is ``HF_HOME/hub``)."""
    from darts_bench.pool.rehearsal import build_rehearsal_hub

    pool = micro_pipeline.pool()
    home = tmp_path_factory.mktemp("rehearsal-hf")
    build_rehearsal_hub({"base": pool.base, **pool.experts}, home / "hub")
    return home


@pytest.fixture(scope="session")
def llama3_hub(data_dir, tmp_path_factory) -> Path:
    """The 3B-shaped Llama-3 rehearsal pool (darts_bench/pool/rehearsal_llama3.py: MergeBench's hub ids)
    laid out in a hub cache; returns its HF_HOME (the cache is ``HF_HOME/hub``)."""
    from darts_bench.pool.rehearsal_llama3 import build_llama3_rehearsal_hub

    home = tmp_path_factory.mktemp("llama3-hf")
    build_llama3_rehearsal_hub(data_dir, home / "hub")
    return home


#: the smollm2-135m preset as the plan and scripts tests were written against it and its measured runs were made
#: with (the 2026-12-05 reference: two data merges, Surgery and DARTS, the task-agnostic rows, 24 benchmark rows);
#: the preset since has five merges and the DARTS ingredients, which change every count those tests check but none
#: of the planner's rules
SMOLLM2_2026_12_05 = [
    "merges=[{name: adamerging, method: adamerging, steps: 30, batch_size: 4, lr: 1.0e-3, init: 0.3}, "
    "{name: regmean, method: regmean, alpha: 0.9}]",
    "surgery.methods=[surgery, darts]", "surgery.task_agnostic=[routed, shared]",
    "evaluate.rows=[base, 'expert:*', adamerging, regmean, '*+surgery', '*+darts', '*+surgery[[]rank=matched]', "
    "'*+surgery@routed', '*+darts@routed', '*+surgery@shared', '*+darts@shared', '*@inductive']"]
