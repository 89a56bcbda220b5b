"""The cluster recipes in ray_configs/: the KubeRay RayJob (ray_configs/rayjob.yaml) validated against
KubeRay's RayJob CRD schema (vendored: ray_configs/kuberay/) and the SLURM scripts (ray_configs/slurm.sbatch,
slurm_array.sbatch, slurm_array_submit.sh). Nothing is launched here (tests/test_slurm.py runs the SLURM
scripts under a real slurmctld): the RayJob's schema and fields, the scripts' shell syntax (`bash -n`) and
SBATCH header, and the exact darts-bench command they run, parsed by darts-bench's own CLI and config
loader, sized against the llama2-7b config."""

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


def _crd_schema() -> dict:
    import json

    return json.loads((RAY_CONFIGS / "kuberay" / "ray.io_rayjobs.v1.schema.json").read_text())


def _k8s_validations(schema: dict, obj, path: str = "") -> list[tuple[str, str, object]]:
    """Every ``x-kubernetes-validations`` rule (CEL) on the way down ``obj``: (path, rule, value there)."""
    out = [(path, v["rule"], obj) for v in schema.get("x-kubernetes-validations", [])]
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = schema.get("properties", {}).get(k) or schema.get("additionalProperties")
            if isinstance(sub, dict):
                out += _k8s_validations(sub, v, f"{path}.{k}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(obj):
            out += _k8s_validations(schema["items"], v, f"{path}[{i}]")
    return out


def test_rayjob_validates_against_the_kuberay_crd_schema():
    """rayjob.yaml against the RayJob CRD's openAPIV3Schema (KubeRay v1.7.0) with jsonschema; the CEL rules on
    the way (``x-kubernetes-validations``, which jsonschema does not run) are checked by hand for the two
    blocks this file uses (deletionStrategy and its rules), and a document the schema must refuse is refused."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = _crd_schema()
    assert "KubeRay v1.7.0" in schema["$comment"] and "Apache License 2.0" in schema["$comment"]
    job = yaml.safe_load((RAY_CONFIGS / "rayjob.yaml").read_text())
    # quantities are int-or-string in Kubernetes; the CRD marks them with x-kubernetes-int-or-string
    jsonschema.Draft7Validator(schema).validate(job)
    for bad, where in [({"submissionMode": 3}, "submissionMode"),
                       ({"deletionStrategy": {"deletionRules": [{"policy": "DeleteEverything",
                                                                 "condition": {"jobStatus": "FAILED"}}]}},
                        "policy"),
                       ({"ttlSecondsAfterFinished": "600"}, "ttlSecondsAfterFinished")]:
        with pytest.raises(jsonschema.ValidationError, match=where):
            jsonschema.Draft7Validator(schema).validate({**job, "spec": {**job["spec"], **bad}})
    spec = job["spec"]
    assert spec["submissionMode"] == "SidecarMode"
    sm = schema["properties"]["spec"]["properties"]["submissionMode"]
    assert sm == {"default": "K8sJobMode", "type": "string"}  # the enum is the operator's: SidecarMode since 1.3
    # rules mode: no legacy onSuccess/onFailure, no shutdownAfterJobFinishes / global TTL beside the rules
    assert not {"shutdownAfterJobFinishes", "ttlSecondsAfterFinished"} & set(spec)
    rules = spec["deletionStrategy"]["deletionRules"]
    assert set(spec["deletionStrategy"]) == {"deletionRules"} and rules
    checks = {r for _, r, _ in _k8s_validations(schema, job)}
    assert "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))" in checks
    assert "has(self.jobStatus) || has(self.jobDeploymentStatus)" in checks
    for r in rules:  # the CEL rules of a condition, evaluated here by hand
        cond = r["condition"]
        assert ("jobStatus" in cond) != ("jobDeploymentStatus" in cond) and cond.get("ttlSeconds", 0) >= 0
    pairs = [(r["condition"]["jobStatus"], r["policy"]) for r in rules]
    assert len(pairs) == len(set(pairs))  # the operator refuses duplicate (status, policy) rules
    ttl = {p: r["condition"]["ttlSeconds"] for p, r in zip(pairs, rules)}
    # the operator's TTL order for one status: workers go no later than the cluster
    assert ttl[("FAILED", "DeleteWorkers")] <= ttl[("FAILED", "DeleteCluster")]
    # SidecarMode's constraints (KubeRay validation.go): head restartPolicy unset or Never, no submitter template
    assert spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].get("restartPolicy", "Never") == "Never"
    assert not {"submitterPodTemplate", "submitterConfig", "clusterSelector"} & set(spec)


def test_rayjob_has_the_kuberay_fields_and_runs_the_command():
    job = yaml.safe_load((RAY_CONFIGS / "rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
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
    # the defaults: DARTS_BENCH_RUN_ARGS "--suite all", DARTS_BENCH_CONFIG llama2-7b
    subst = {'"${RUN_ARGS[@]}"': "--suite all", "${RUN_ARGS[@]}": "--suite all", "$CONFIG": "llama2-7b",
             "$NAME": "llama2-7b", "$SHARED": shared}
    out = []
    for a in shlex.split(submit.split(" -- ", 1)[1].replace('"${RUN_ARGS[@]}"', "--suite all")):
        for k, v in subst.items():
            a = a.replace(k, v)
        out.append(a)
    assert argv  # parsed
    _check_command(out, shared)
    assert "--runtime-env ray_configs/runtime_env.yaml" in submit
    assert 'CONFIG=${DARTS_BENCH_CONFIG:-llama2-7b}' in lines and 'NAME=$(basename "$CONFIG" .yaml)' in lines
    assert 'read -r -a RUN_ARGS <<<"${DARTS_BENCH_RUN_ARGS:---suite all}"' in lines


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("name", ["slurm_array.sbatch", "slurm_array_submit.sh"])
def test_slurm_array_scripts_parse(name):
    res = subprocess.run(["bash", "-n", str(RAY_CONFIGS / name)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = (RAY_CONFIGS / name).read_text()
    assert not re.search(r"^[^#]*\bray stop\b", text, re.M)
    if name == "slurm_array_submit.sh":  # the report waits for every array element, which waits for prepare
        assert "--dependency=afterok:\"${prep%%;*}\"" in text and "--dependency=afterok:\"${shards%%;*}\"" in text
