"""Ray executor: same outputs as the local executor, retries, failures, `ray job submit`, cleanup.

Everything runs on a tiny random Llama built in a temp dir (no hub). Ray stays on 127.0.0.1; every
Ray process a test starts is stopped by pid (never ``ray stop``, which would stop other people's).
About a minute and a half on two shared cores.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.subprocess,
              pytest.mark.timeout(240)]  # a scheduling hang fails the test instead of the whole run

from darts_bench.config import CalibrationConfig, Config, RayConfig  # noqa: E402
from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm  # noqa: E402
from darts_bench.executors.local import LocalExecutor  # noqa: E402
from darts_bench.executors.ray_executor import RayExecutor, RayTextModel, head_processes, stop_head  # noqa: E402
from ray_cluster import pid_alive  # noqa: E402  (tests/ray_cluster.py)

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
BATCH = 2
SHARD = 3

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Question: Tom has 3 apples and buys 4 more. How many apples?\nAnswer: 7",
    "### Instruction:\nWrite a haiku about the sea.\n\n### Response:\nWaves fold into foam",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "Natalia sold clips to 48 of her friends in April, and then half as many in May.",
]
PROMPTS = ["def add(a, b):", "Question: Tom has 3 apples", "The quick", "for i in range(",
           "### Instruction:\nWrite a poem.\n\n### Response:\n", "Natalia sold clips to", "x"]


# ----------------------------------------------------------------------------------- helpers
def build_tiny_checkpoint(out: Path, hidden: int = 32, layers: int = 2, vocab: int = 300, seed: int = 0) -> Path:
    """A random ``LlamaForCausalLM`` + byte-level BPE tokenizer saved as an HF checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|pad|>", padding_side="left", model_max_length=4096)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, bos_token_id=fast.eos_token_id,
                      eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
                                               bos_token_id=fast.eos_token_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return out


def make_cfg(**ray_kw) -> Config:
    ray_cfg = dict(num_actors=2, num_cpus_per_actor=1, shard_size=SHARD, max_restarts=1, max_task_retries=1)
    ray_cfg.update(ray_kw)
    return Config(calibration=CalibrationConfig(batch_size=BATCH), torch_threads=1, ray=RayConfig(**ray_cfg))


def feature_payloads(ckpt: Path) -> list[dict]:
    tok = load_causal_lm(ckpt)[1]
    seqs = [tok(t)["input_ids"][: 8 + 3 * i] for i, t in enumerate(TEXTS + TEXTS[:2])]  # 8 sequences
    return [{"sequences": seqs[i:i + SHARD]} for i in range(0, len(seqs), SHARD)]  # 3 shards


def local_features(ckpt: Path, payloads: list[dict]) -> list[dict]:
    threads = torch.get_num_threads()
    try:
        return LocalExecutor(batch_size=BATCH, torch_threads=1).map(str(ckpt), "features", payloads)
    finally:
        torch.set_num_threads(threads)


def assert_same_features(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for k in w:
            if isinstance(w[k], dict):  # the encoding's dtype tags (bf16 travels as int16 bits)
                assert g[k] == w[k], k
                continue
            assert g[k].dtype == w[k].dtype and np.array_equal(g[k], w[k]), k  # bitwise


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _wait_gone(pids: set[int], timeout: float = 20.0) -> set[int]:
    """Wait for ``pids`` to exit; kill (by pid) whatever is left; return the ones that were left."""
    deadline = time.time() + timeout
    alive = {p for p in pids if psutil.pid_exists(p)}
    while alive and time.time() < deadline:
        time.sleep(0.25)
        alive = {p for p in alive if pid_alive(p)}
    left = set(alive)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left




LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def _listen_addrs(pids: set[int]) -> set[str]:
    """Addresses the processes ``pids`` listen on (TCP)."""
    return {c.laddr.ip for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def crash_once_worker():
    """A ModelWorker that exits its process on a shard with ``crash_marker`` whose marker file does
    not exist yet (it creates it first): the first attempt dies, the retry succeeds. Defined in a
    function so that Ray ships the class by value to the actors."""
    from darts_bench.executors.worker import ModelWorker

    class CrashOnceWorker(ModelWorker):
        def run(self, op, payload):
            marker = payload.get("crash_marker")
            if marker and not os.path.exists(marker):
                Path(marker).write_text(str(os.getpid()))
                os._exit(1)
            if payload.get("always_crash"):
                os._exit(1)
            return super().run(op, payload)

    return CrashOnceWorker


# ---------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="module")
def ray_session(ray_instance):
    """The test run's shared local Ray instance (tests/conftest.py ``ray_instance``: loopback, private
    temp dir, stopped by pid at the end of the run, asserting nothing is left)."""
    yield ray_instance


@pytest.fixture(scope="module")
def ray_ex(ray_session):
    ex = RayExecutor(make_cfg(), keep_idle=True)
    yield ex
    ex.close()


# ------------------------------------------------------------------------------------- tests
# (f) runs first, before the run's shared Ray instance exists (no earlier test file asks for it): the
# executor starts and stops its own.
def test_executor_owns_its_local_ray_and_leaves_no_process(ckpt):
    if ray.is_initialized():
        pytest.skip("Ray already initialised in this process")
    before, auth = _children(), os.environ.get("RAY_AUTH_MODE")
    ex = RayExecutor(make_cfg(num_actors=1))
    try:
        assert ray.is_initialized() and ex._owns_ray
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        assert ex.map(str(ckpt), "ping", [{}, {}]) == ["ok", "ok"]
        started = _children() - before
        assert started, "a local Ray instance should have started child processes"
        addrs = _listen_addrs(started | {os.getpid()})
        assert addrs and addrs <= LOOPBACK, f"Ray listens beyond loopback: {addrs}"
    finally:
        started = _children() - before
        ex.close()
        if auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
    assert not ray.is_initialized()
    left = _wait_gone(started)
    assert not left, f"processes left after RayExecutor.close() (killed): {left}"
    assert not (_children() - before)


def test_features_identical_to_local(ckpt, ray_ex):
    payloads = feature_payloads(ckpt)
    want = local_features(ckpt, payloads)
    seen = []
    got = ray_ex.map(str(ckpt), "features", payloads, on_result=lambda i, r: seen.append(i))
    assert sorted(seen) == [0, 1, 2]
    assert_same_features(got, want)
    assert all(v.flags.writeable for r in got for v in r.values() if isinstance(v, np.ndarray))  # copied out of the object store
    assert len(ray_ex._groups[("hf", str(ckpt), BATCH)].actors) == 2  # kept loaded (keep_idle)

    # skipped shards (already persisted by a previous run) are not recomputed and come back as None
    seen.clear()
    part = ray_ex.map(str(ckpt), "features", payloads, skip={0, 2}, on_result=lambda i, r: seen.append(i))
    assert seen == [1] and part[0] is None and part[2] is None
    assert_same_features([part[1]], [want[1]])


def test_generation_identical_to_local(ckpt, ray_ex):
    model, tok = load_causal_lm(ckpt)
    local = HFTextModel("m", model, tok, batch_size=BATCH)
    tm = ray_ex.text_model("m", str(ckpt), batch_size=BATCH)
    try:
        assert isinstance(tm, RayTextModel) and tm.name == "m"
        assert tm.chunk_size == 4  # shard_size 3 rounded up to a multiple of the batch size 2
        kw = dict(max_new_tokens=6)
        assert tm.generate_ids(PROMPTS, **kw) == local.generate_ids(PROMPTS, **kw)
        assert tm.generate(PROMPTS, stop=["\n"], **kw) == local.generate(PROMPTS, stop=["\n"], **kw)
        # sampling: seeds per (seed, prompt, sample index) reproduce the in-process samples whatever the chunks
        kw = dict(max_new_tokens=5, temperature=1.0, num_samples=2, seed=11)
        assert tm.generate_ids(PROMPTS, **kw) == local.generate_ids(PROMPTS, **kw)
        ctx, cont = PROMPTS, [" a b", " c", "d e f", " (", "Hi", " 48", "y"]
        got, want = tm.score(ctx, cont), local.score(ctx, cont)
        assert [(s.nll, s.n_tokens, s.greedy, s.token_nll) for s in got] == \
               [(s.nll, s.n_tokens, s.greedy, s.token_nll) for s in want]
        assert tm.format_chat("hi") == local.format_chat("hi")
        assert tm.generate([], max_new_tokens=3) == []
        with pytest.raises(ValueError, match="greedy"):
            tm.generate(PROMPTS, max_new_tokens=3, num_samples=2)
    finally:
        tm.close()
    with pytest.raises(RuntimeError, match="closed"):
        tm.generate(PROMPTS, max_new_tokens=1)
    assert not ray_ex._groups  # closing the last proxy of a model kills its actors


def test_two_open_models_on_a_full_instance_take_turns(ckpt, ray_session):
    """Two open proxies whose actors cannot both fit (one actor of 2 CPUs each, on 2 CPUs): each
    call evicts the other's idle group instead of waiting forever (a model and its AlpacaEval judge)."""
    model, tok = load_causal_lm(ckpt)
    ex = RayExecutor(make_cfg(num_actors=1, num_cpus_per_actor=2))
    try:
        a, b = ex.text_model("a", str(ckpt), batch_size=1), ex.text_model("b", str(ckpt), batch_size=2)
        for tm in (a, b, a):
            want = HFTextModel("m", model, tok, batch_size=tm.batch_size).generate_ids(PROMPTS[:3], max_new_tokens=3)
            assert tm.generate_ids(PROMPTS[:3], max_new_tokens=3) == want
            assert list(ex._groups) == [tm._key]  # the other group was released to make room
        a.close()
        b.close()
        assert not ex._groups
    finally:
        ex.close()


def test_ray_config_files():
    """ray_configs/: local.yaml is a valid darts-bench config, cluster.yaml passes the cluster
    launcher's schema, runtime_env.yaml is a valid runtime env that leaves out the heavy dirs."""
    import yaml
    from ray.autoscaler._private.util import validate_config
    from ray.runtime_env import RuntimeEnv

    from darts_bench.config import load_config

    cfg = load_config(str(REPO / "ray_configs" / "local.yaml"))
    assert cfg.executor == "ray" and cfg.ray.address is None
    cluster = yaml.safe_load((REPO / "ray_configs" / "cluster.yaml").read_text())
    validate_config(cluster)
    assert cluster["head_node_type"] in cluster["available_node_types"]
    env = yaml.safe_load((REPO / "ray_configs" / "runtime_env.yaml").read_text())
    RuntimeEnv(**env)
    assert env["working_dir"] == "." and {".venv/", "work/"} <= set(env["excludes"])
    assert {"DARTS_BENCH_DATA", "HF_HOME"} <= set(env["env_vars"])


@pytest.mark.parametrize("max_restarts", [1, 0], ids=["ray-restarts-actor", "driver-resubmits"])
def test_actor_killed_mid_collection_is_retried(ckpt, ray_session, tmp_path, max_restarts):
    payloads = feature_payloads(ckpt)
    want = local_features(ckpt, payloads)
    marker = tmp_path / "crashed"
    crashy = [dict(p) for p in payloads]
    crashy[1]["crash_marker"] = str(marker)  # the second shard kills its actor on the first attempt
    ex = RayExecutor(make_cfg(max_restarts=max_restarts, max_task_retries=1), worker_cls=crash_once_worker())
    try:
        got = ex.map(str(ckpt), "features", crashy)
        assert not ex._groups  # map released its actors (keep_idle False)
    finally:
        ex.close()
    assert marker.is_file(), "the worker should have died once"
    assert_same_features(got, want)


def test_shard_that_always_fails_names_the_shard(ckpt, ray_session):
    payloads = feature_payloads(ckpt)
    payloads[1] = {**payloads[1], "always_crash": True}
    ex = RayExecutor(make_cfg(max_restarts=0, max_task_retries=1), worker_cls=crash_once_worker())
    try:
        with pytest.raises(RuntimeError, match=rf"shard 1 of op 'features' on model {ckpt}.*died 2 times"):
            ex.map(str(ckpt), "features", payloads)
        # an error raised by the op itself is not retried and names the shard too
        with pytest.raises(RuntimeError, match=r"shard 0 of op 'nope' on model .*ValueError: unknown worker op"):
            ex.map(str(ckpt), "nope", [{}])
    finally:
        ex.close()


def test_ray_job_submit_on_loopback_head(tmp_path):
    """`ray start --head` on 127.0.0.1 (auth disabled), `ray job submit`, then stop it by pid
    (``stop_head``, as ray_configs/README.md says; never `ray stop`)."""
    ray_bin = VENV_BIN / "ray"
    temp_dir = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: Ray's socket paths must fit
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: keep 127.0.0.1 as the node IP (else Ray swaps in the
    # routable address and listens on every interface)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "RAY_USAGE_STATS_ENABLED": "0"}
    dash, gcs_port = _free_port(), _free_port()
    cmd = [str(ray_bin), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port),
           "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
           "--dashboard-agent-listen-port", str(_free_port()), "--ray-client-server-port", str(_free_port()),
           "--num-cpus", "1", "--temp-dir", str(temp_dir), "--disable-usage-stats"]
    seen: set[int] = set()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        seen |= {p.pid for p in head_processes(str(temp_dir), gcs_port)}
        addrs = _listen_addrs(seen)
        assert addrs and addrs <= LOOPBACK, f"the head listens beyond loopback: {addrs}"
        sid = f"darts-test-{uuid.uuid4().hex[:8]}"
        address = f"http://127.0.0.1:{dash}"
        job = subprocess.run([str(ray_bin), "job", "submit", "--address", address, "--submission-id", sid,
                              "--", "python", "-c", "import darts_bench; print('darts-bench-job-ok')"],
                             env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert job.returncode == 0, job.stdout + job.stderr
        assert "darts-bench-job-ok" in job.stdout
        logs = subprocess.run([str(ray_bin), "job", "logs", "--address", address, sid], env=env,
                              capture_output=True, text=True, timeout=60)
        assert logs.returncode == 0 and "darts-bench-job-ok" in logs.stdout, logs.stdout + logs.stderr
        status = subprocess.run([str(ray_bin), "job", "status", "--address", address, sid], env=env,
                                capture_output=True, text=True, timeout=60)
        assert f"Job '{sid}' succeeded" in status.stdout + status.stderr, status.stdout + status.stderr  # SUCCEEDED
    finally:
        seen |= {p.pid for p in head_processes(str(temp_dir), gcs_port)}
        stopped = stop_head(str(temp_dir), gcs_port)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert seen and seen <= set(stopped) | {p for p in seen if not pid_alive(p)}
    left = [p for p in seen | set(stopped) if pid_alive(p)] + [p.pid for p in head_processes(str(temp_dir), gcs_port)
                                                            if pid_alive(p.pid)]
    assert not left, f"head processes still running after stop_head: {left}"
