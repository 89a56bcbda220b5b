"""Helpers of scripts/gpu_pipeline_check.py on synthetic inputs (the script itself runs on a device or
as its CPU dry run; see its docstring)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_pipeline_check.py"


@pytest.fixture(scope="module")
def gpc():
    spec = importlib.util.spec_from_file_location("gpu_pipeline_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class CharTok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _res(texts):
    return SimpleNamespace(samples=[{"completion": t} for t in texts])


def test_generation_divergence_counts_and_first_token(gpc):
    ref = {"m": {"humaneval": _res(["abc", "xyz", "same"])}}
    new = {"m": {"humaneval": _res(["abd", "xyz", "same!"])}}
    out = gpc.compare_generations(ref, new, CharTok())
    assert (out["prompts_compared"], out["divergent_prompts"], out["identical"]) == (3, 2, False)
    per = out["per_row_task"]["m/humaneval"]
    assert [d["first_divergent_token"] for d in per["examples"]] == [2, 4]
    assert per["first_divergent_token_min"] == 2


def test_feature_diff_uses_only_identical_sequences(gpc):
    fa = {"h": torch.tensor([[1.0], [2.0], [3.0]]), "entropy": torch.tensor([0.1, 0.2, 0.3]),
          "seq_index": torch.tensor([0, 0, 1])}
    fb = {"h": torch.tensor([[1.0], [2.5], [9.0], [9.0]]), "entropy": torch.tensor([0.1, 0.2, 0.3, 0.3]),
          "seq_index": torch.tensor([0, 0, 1, 1])}
    d = gpc._feat_diff(fa, fb, [[1, 2], [3]], [[1, 2], [3, 4]])
    assert (d["identical_sequences"], d["of"]) == (1, 2)
    assert d["h_max_abs_diff"] == pytest.approx(0.5) and d["entropy_max_abs_diff"] == 0.0


def test_column_drift(gpc, tmp_path):
    for name, v in (("a", 1.0), ("b", 1.5)):
        (tmp_path / name).mkdir()
        rows = [{"model": "x", "ref_nll": v, "flag": True, "n": 4}, {"model": "y", "ref_nll": 2.0, "flag": False, "n": 4}]
        (tmp_path / name / "results.json").write_text(json.dumps({"rows": rows}))
    d = gpc.column_drift(tmp_path / "a", tmp_path / "b")
    assert d["ref_nll"] == {"rows": 2, "max_abs": 0.5, "mean_abs": 0.25, "max_rel": 0.5}
    assert "flag" not in d and d["n"]["max_abs"] == 0.0
