"""Backend selection: ``evaluate.backend`` / ``calibration.backend`` validated; ``vllm`` without the
extra fails before any stage with the install command; the vLLM plugin is declared for vLLM's
spawned workers."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import pytest

from darts_bench.config import ConfigError, load_config
from darts_bench.evaluate.backends import vllm_available

REPO = Path(__file__).resolve().parent.parent


def test_backend_values_validated():
    assert load_config("tiny").evaluate.backend == "hf" and load_config("tiny").calibration.backend == "hf"
    with pytest.raises(ConfigError, match="evaluate.backend"):
        load_config("tiny", ["evaluate.backend=vlm"])
    with pytest.raises(ConfigError, match="evaluate.vllm.kv_cache_gb"):
        load_config("tiny", ["evaluate.backend=vllm", "evaluate.vllm.kv_cache_gb=0.5"])


@pytest.mark.skipif(vllm_available(), reason="vllm is installed here")
@pytest.mark.parametrize("key", ["evaluate.backend", "calibration.backend"])
def test_vllm_backend_without_vllm_fails_before_any_stage(tmp_path, key):
    from darts_bench.pipeline import Pipeline

    cfg = load_config("tiny", [f"{key}=vllm", f"work_dir={tmp_path / 'work'}"])
    with pytest.raises(ImportError, match=rf"{key}=vllm: vllm is not installed.*install_vllm_cpu\.sh"):
        Pipeline(cfg)
    assert not (tmp_path / "work").exists()  # nothing started
    Pipeline(load_config("tiny", [f"work_dir={tmp_path / 'work'}"]))  # the HF path is unaffected


def test_vllm_plugin_entry_point_declared_and_light():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    ep = meta["project"]["entry-points"]["vllm.general_plugins"]["darts_bench"]
    mod, func = ep.split(":")
    before = "vllm" in sys.modules
    plugin = importlib.import_module(mod)
    assert callable(getattr(plugin, func))
    assert ("vllm" in sys.modules) == before  # loading the plugin module imports no vllm
    cls_mod = plugin.MODEL_CLASS.split(":")[0]
    assert (REPO / (cls_mod.replace(".", "/") + ".py")).is_file()
