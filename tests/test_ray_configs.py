"""The cluster recipes in ray_configs/: the KubeRay RayJob (ray_configs/rayjob.yaml) and the SLURM
script (ray_configs/slurm.sbatch). Neither is launched here: the RayJob's required fields, the
script's shell syntax (`bash -n`) and SBATCH header, and the exact darts-bench command both run,
parsed by darts-bench's own CLI and config loader, sized against the llama2-7b config."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from darts_bench.cli import build_parser
from darts_bench.config import load_config

pytestmark = [pytest.mark.subprocess]  # `bash -n` on the SLURM script

RAY_CONFIGS = Path(__file__).resolve().parent.parent / "ray_configs"
# the command both recipes run (README "Command line"; ray_configs/README.md), then the absolute
# results and work dirs on the shared file system
COMMAND = ["darts-bench", "run", "--suite", "all", "--config", "llama2-7b", "--set", "executor=ray",
           "--set", "ray.address=auto"]


def _check_command(argv: list[str], shared: str) -> None:
    """``argv`` is COMMAND plus an absolute ``--out`` and ``work_dir`` under ``shared``, and a valid
    darts-bench command whose config runs on Ray, joining the job's cluster."""
    assert argv[:len(COMMAND)] == COMMAND
    assert argv[len(COMMAND):] == ["--out", f"{shared}/results/llama2-7b", "--set", f"work_dir={shared}/work"]
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.suite, args.config) == ("run", "all", "llama2-7b")
    cfg = load_config(args.config, args.overrides)
    assert (cfg.executor, cfg.ray.address) == ("ray", "auto")
    assert Path(cfg.work_dir).is_absolute() and Path(args.out).is_absolute()


def _gpus(resources: dict) -> int:
    return int(resources.get("limits", {}).get("nvidia.com/gpu", 0))


def test_rayjob_has_the_kuberay_fields_and_runs_the_command():
    job = yaml.safe_load((RAY_CONFIGS / "rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] > 0
    _check_command(shlex.split(spec["entrypoint"]), "/mnt/shared")
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]  # a YAML document inside a string
    assert env["DARTS_BENCH_DATA"] == "/mnt/shared/data" and env["TOKENIZERS_PARALLELISM"] == "false"

    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"].startswith("2.60.")
    head = cluster["headGroupSpec"]["template"]["spec"]
    workers = cluster["workerGroupSpecs"]
    assert isinstance(cluster["headGroupSpec"]["rayStartParams"], dict) and workers
    cfg = load_config("llama2-7b")
    gpus = sum(w["replicas"] * _gpus(w["template"]["spec"]["containers"][0]["resources"]) for w in workers)
    cpus = sum(w["replicas"] * int(w["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
               for w in workers)
    assert gpus >= cfg.ray.num_actors * cfg.ray.num_gpus_per_actor and _gpus(head["containers"][0]["resources"]) == 0
    assert cpus >= cfg.ray.num_actors * cfg.ray.num_cpus_per_actor
    for pod in [head] + [w["template"]["spec"] for w in workers]:  # the shared volume at one path on every pod
        (c,) = pod["containers"]
        assert {"name": "shared", "mountPath": "/mnt/shared"} in c["volumeMounts"]
        assert pod["volumes"] == [{"name": "shared", "persistentVolumeClaim": {"claimName": "darts-bench-shared"}}]
        assert c["image"] == head["containers"][0]["image"]


def _script_lines() -> list[str]:
    """The script's lines with backslash continuations joined."""
    return (RAY_CONFIGS / "slurm.sbatch").read_text().replace("\\\n", " ").splitlines()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_slurm_script_parses_and_submits_the_command():
    path = RAY_CONFIGS / "slurm.sbatch"
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    lines = _script_lines()
    assert lines[0] == "#!/bin/bash"
    # sbatch reads #SBATCH lines only before the first command
    first_cmd = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    sbatch = {m.group(1): m.group(2) for ln in lines[:first_cmd] if (m := re.match(r"#SBATCH --([\w-]+)=?(\S*)", ln))}
    assert not any(ln.startswith("#SBATCH") for ln in lines[first_cmd:])
    cfg = load_config("llama2-7b")
    workers = int(sbatch["nodes"]) - 1
    assert workers >= 1 and workers * int(sbatch["gpus-per-node"]) >= cfg.ray.num_actors * cfg.ray.num_gpus_per_actor

    # a head, then a worker per other node, each an srun step kept alive with --block
    code = [ln for ln in lines if not ln.lstrip().startswith("#")]
    starts = [ln for ln in code if "ray start" in ln]
    assert len(starts) == 2 and all(s.lstrip().startswith("srun ") and "--block" in s for s in starts)
    assert "--head" in starts[0] and '--address="$RAY_ADDRESS"' in starts[1]
    assert not any(re.search(r"\bray stop\b", ln) for ln in code)

    (submit,) = [ln for ln in code if ln.lstrip().startswith("ray job submit")]
    argv = shlex.split(submit)
    argv = argv[argv.index("--") + 1:]
    shared = "/shared/darts"
    _check_command([a.replace("$SHARED", shared) for a in argv], shared)
    assert "--runtime-env ray_configs/runtime_env.yaml" in submit
