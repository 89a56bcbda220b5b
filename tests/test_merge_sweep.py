"""Merge settings as a researcher sweeps them: per-expert weights and densities, ``--sweep merges.NAME.KEY=...``
(one merge variant per value, rows named by the setting), beside and together with the head sweeps."""

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from darts_bench.config import ConfigError, Config, load_config, sweep_override
from darts_bench.rows import row_names, surgery_variants


def test_merge_sweep_expands_into_named_variants():
    cfg = load_config("tiny", [sweep_override("merges.ties.density=0.2,0.4")])
    names = [m.name for m in cfg.merges]
    assert names == ["linear", "task_arithmetic", "ties[density=0.2]", "ties[density=0.4]", "dare_ties", "dare_linear"]
    v = {m.name: m for m in cfg.merges}
    assert v["ties[density=0.4]"].density == 0.4 and v["ties[density=0.4]"].normalize is True  # the rest kept
    rows = row_names(cfg)
    assert "ties[density=0.4]" in rows and "ties[density=0.4]+darts" in rows and "ties[density=0.2]+surgery@inductive" in rows
    assert not any(r == "ties" or r.startswith("ties+") for r in rows)
    # a results file's config (the dump, sweep included) reads back to the same merges: expansion is idempotent
    again = Config.model_validate(cfg.model_dump(mode="json"))
    assert [m.model_dump(mode="json") for m in again.merges] == [m.model_dump(mode="json") for m in cfg.merges]


def test_merge_and_head_sweeps_combine_and_order():
    cfg = load_config("tiny", [sweep_override("merges.ties.density=0.2,0.4"), sweep_override("merges.ties.weight=0.5,1"),
                               sweep_override("surgery.w_max=1,2")])
    ties = [m.name for m in cfg.merges if m.method == "ties"]
    assert ties == ["ties[density=0.2,weight=0.5]", "ties[density=0.2,weight=1]", "ties[density=0.4,weight=0.5]",
                    "ties[density=0.4,weight=1]"]
    assert [t for t, _ in surgery_variants(cfg)] == ["[w_max=1]", "[w_max=2]"]
    assert "ties[density=0.4,weight=1]+darts[w_max=2]" in row_names(cfg)


def test_head_sweep_alone_and_a_scalar_weight_keep_their_names():
    """What a new user tries first: one weight per merge, a sweep over head settings only."""
    cfg = load_config("tiny", ["merges=[{name: ta, method: task_arithmetic, weight: 0.4}]",
                               sweep_override("surgery.w_max=1,2")])
    assert [m.name for m in cfg.merges] == ["ta"] and cfg.merges[0].weight == 0.4
    assert "ta+darts[w_max=2]" in row_names(cfg) and "ta" in row_names(cfg)


def test_per_expert_weights_checked_against_the_pool():
    cfg = load_config("tiny", ["merges=[{name: ta, method: task_arithmetic, weight: {code: 0.2, math: 0.3, "
                               "instruction: 0.5}}]"])
    assert cfg.merges[0].expert_value("weight", "math") == 0.3
    with pytest.raises(ConfigError, match=r"weight \{'code': 0.2, 'maths': 0.3, 'instruction': 0.5\} must name every "
                       r"expert of the pool \['code', 'math', 'instruction'\]; missing \['math'\]; not experts of the "
                       r"pool: \['maths'\]"):
        load_config("tiny", ["merges=[{name: ta, method: task_arithmetic, weight: {code: 0.2, maths: 0.3, "
                             "instruction: 0.5}}]"])
    with pytest.raises(ConfigError, match=r"density .* out of range: each value must be > 0 and <= 1"):
        load_config("tiny", ["merges=[{name: t, method: ties, density: {code: 0.2, math: 1.3, instruction: 0.5}}]"])


def test_merge_sweep_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"sweep.merges.tie: no merge named 'tie'"):
        load_config("tiny", [sweep_override("merges.tie.density=0.2,0.4")])
    with pytest.raises(ConfigError, match=r"sweep.merges.ties.densty: not a merge setting"):
        load_config("tiny", [sweep_override("merges.ties.densty=0.2,0.4")])
    with pytest.raises(ConfigError, match=r"sweep.merges.ties.method: not a merge setting"):
        load_config("tiny", [sweep_override("merges.ties.method=ties,dare_ties")])
    with pytest.raises(ConfigError, match=r"method task_arithmetic takes no density"):
        load_config("tiny", [sweep_override("merges.task_arithmetic.density=0.2,0.4")])
    with pytest.raises(ValueError, match=r"merges.NAME.KEY=v1,v2"):
        sweep_override("merges.ties=0.2,0.4")
    assert sweep_override("merges.ties.lambda=0.5,1") == 'sweep.merges.ties.lambda=[0.5, 1]'
    cfg = load_config("tiny", [sweep_override("merges.ties.lambda=0.5,1")])
    assert [m.lambda_ for m in cfg.merges if m.method == "ties"] == [0.5, 1]


@pytest.mark.micro
@pytest.mark.slow
def test_merge_sweep_runs_one_set_of_rows_per_value(micro_dir, micro_pipeline, capsys):
    """``--sweep merges.ties.density=0.2,0.4`` on the micro tiny pool: two TIES merges built (different
    weights, each cached under its own key), each with its own features, heads and evaluated rows."""
    from safetensors.torch import load_file

    from darts_bench.cli import main

    base = yaml.safe_load((micro_dir / "micro.yaml").read_text())
    base["merges"] = base["merges"][:1]  # ties, density 0.5
    base["calibration"]["splits"] = ["transductive"]
    d = micro_dir / "merge-sweep"
    d.mkdir()
    base["out_dir"] = str(d / "results")
    cfg_path = d / "sweep.yaml"
    cfg_path.write_text(yaml.safe_dump(base))
    capsys.readouterr()
    assert main(["run", "--config", str(cfg_path), "--suite", "gsm8k", "--limit", "2",
                 "--sweep", "merges.ties.density=0.2,0.4", "--rows", "ties*"]) == 0
    df = pd.read_csv(d / "results" / "table.csv").set_index("model")
    want = [f"ties[density={v}]{c}" for v in ("0.2", "0.4") for c in ("", "+surgery", "+darts")]
    assert list(df.index) == want
    res = json.loads((d / "results" / "results.json").read_text())
    merges = res["manifest"]["merges"]
    assert sorted(merges) == ["ties[density=0.2]", "ties[density=0.4]"]
    work = Path(base["work_dir"]) / "merges"
    w = {m: load_file(str(work / p / "model.safetensors")) for m, p in merges.items()}
    key = "model.layers.0.mlp.up_proj.weight"
    assert not w["ties[density=0.2]"][key].equal(w["ties[density=0.4]"][key])
    assert all("[" not in p for p in merges.values())  # dir names without glob characters
    # one set of heads per variant: the DARTS rows of the two variants differ on the behaviour signal
    assert df.loc["ties[density=0.2]+darts", "gsm8k_rep_l1"] != df.loc["ties[density=0.4]+darts", "gsm8k_rep_l1"]
    heads = {h.name.split("-gsm8k-")[0] for h in (Path(base["work_dir"]) / "heads").iterdir()
             if h.name.startswith("ties[") and "-gsm8k-" in h.name}
    assert heads == {"ties[density=0.2]", "ties[density=0.4]"}  # heads trained per variant
