"""Training a correction head under DeepSpeed (``deepspeed.enabled: true``).

The same head, loss, batch order and optimizer as :func:`darts_bench.surgery.train.train_head`,
run data-parallel over ``N = deepspeed.num_procs`` processes with the configured ZeRO stage
(gloo on CPU with ``DS_ACCELERATOR=cpu``, nccl on GPU). Processes come from ``torchrun`` (a
subprocess running this module, features passed as safetensors in ``work_dir``) or from Ray
Train's ``TorchTrainer`` (features passed through the object store).

Exactness: every rank draws the same global batches (:func:`batch_order`) and takes its slice
(``tensor_split``, so any batch size and a final short batch work). The global loss of Eq. (4)/(7)
is ``sum_i w_i l1_i / n`` (``w_i = 1`` for plain L1); rank ``r`` minimises
``sum_{i in slice_r} w_i l1_i * N / n``, and DeepSpeed averages the ranks' gradients, so the
averaged gradient is exactly the in-process one (up to float summation order), whatever the slice
sizes. The optimizer is torch's Adam (``"torch_adam": true, "adam_w_mode": false``), the
optimizer ``train_head`` uses.

Measured (``benchmarks/deepspeed_parity.py``; ``tests/test_deepspeed_train.py``): with one
process the head is bitwise the in-process head at any epoch count; with N processes it is
bitwise the same split arithmetic done in one process (each slice's gradient taken separately,
averaged, then Adam), so DeepSpeed itself (ZeRO partitioning, averaging, Adam, eps) changes
nothing. The in-process trainer sums each batch's gradient in one piece, a different float32
summation order. Because the loss is L1, its gradient holds ``sign(residual)``: once a residual
within rounding of zero takes the other sign, Adam turns that into full-size steps and the two
runs part. At the tiny tier's shapes (d_model 128, rank 16, 256 tokens a step, lr 1e-3) they
agree within 1e-7 for 25 epochs and by epoch 30 differ by ~4e-3 in every tensor; at 40 epochs by
7.3e-3 (max |parameter|) while the held-out entropy-weighted L1 differs by 1.5e-6 relative. The
in-process trainer differs from itself as much when only the order of the tokens inside each
batch is reversed (8.5e-3, 1.0e-5). A DeepSpeed head is therefore a different, equally valid
head: the DeepSpeed settings are part of its cache key, and its metrics can differ from an
in-process run's in the last digits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from darts_bench.surgery.heads import METHODS, CorrectionHead, build_head, load_head, save_head
from darts_bench.surgery.losses import entropy_weights, token_l1
from darts_bench.surgery.train import TokenData, TrainResult, batch_order, evaluate_losses

log = logging.getLogger("darts_bench")
_FIELDS = ("h_merged", "h_expert", "positions", "seq_index", "weight_source")
_ERROR_FILE = "error.json"


# ------------------------------------------------------------------------------ configuration
def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(scfg, ds_cfg, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON: torch's Adam (not AdamW) with ``scfg``'s lr / weight decay, ZeRO stage
    from ``ds_cfg``, micro batch ``scfg.batch_size // world_size`` (>= 1), no accumulation, then
    ``ds_cfg.extra`` merged in (nested dicts merged key by key).

    The batch sizes only describe the run to DeepSpeed (it never loads the data here); the actual
    per-rank slices come from splitting each global batch of ``scfg.batch_size`` tokens."""
    micro = max(1, scfg.batch_size // world_size)
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro * world_size,
        "optimizer": {"type": "Adam", "params": {
            "lr": scfg.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": scfg.weight_decay,
            "torch_adam": True, "adam_w_mode": False}},
        "zero_optimization": {"stage": int(ds_cfg.zero_stage)},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    return _merge(cfg, dict(ds_cfg.extra or {}))


def deepspeed_key(ds_cfg) -> dict[str, Any]:
    """What of the DeepSpeed settings enters a head's cache key: all of ``deepspeed`` (processes,
    ZeRO stage, launcher, extra JSON) and the accelerator the run would use (``cuda``/``cpu``)."""
    return {**ds_cfg.model_dump(mode="json"), "accelerator": "cuda" if _use_cuda() else "cpu"}


def _use_cuda() -> bool:
    return os.environ.get("DS_ACCELERATOR", "") not in ("cpu",) and torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# When set (tests), every rank writes its own final head and history to <dir>/rank-<r>, so that
# all ranks, not only rank 0, can be compared with the in-process trainer.
RANKS_DIR_ENV = "DARTS_BENCH_DS_RANKS_DIR"


def _worker_env(cuda: bool) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not cuda:
        env["DS_ACCELERATOR"] = "cpu"
    if os.environ.get(RANKS_DIR_ENV):
        env[RANKS_DIR_ENV] = os.environ[RANKS_DIR_ENV]
    return env


def _save_rank_copy(head: CorrectionHead, hist: dict) -> None:
    """Every rank's final head under ``$DARTS_BENCH_DS_RANKS_DIR/rank-<r>`` when that is set."""
    d = os.environ.get(RANKS_DIR_ENV)
    if d:
        import torch.distributed as dist

        save_head(head, Path(d) / f"rank-{dist.get_rank()}", extra={"history": hist})


# ------------------------------------------------------------------------------ the per-rank loop
def slice_loss(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], method: str, batch: TokenData,
               mean_h: float, w_max: float, n_global: int, world_size: int) -> torch.Tensor:
    """This rank's share of the global batch loss: ``sum_{i in slice} w_i l1_i * N / n_global``.

    Averaged over the ``N`` ranks it equals Eq. (4) (DARTS) / Eq. (7) (Surgery) on the whole batch,
    ``sum_i w_i l1_i / n_global``, for any split of the batch (an empty slice contributes 0)."""
    out = forward(batch.h_merged, batch.positions)  # [n_r, d]
    per = token_l1(out, batch.h_expert)  # [n_r]
    if METHODS[method][1]:
        per = per * entropy_weights(batch.weight_source, mean_h, w_max)
    return per.sum() * (world_size / n_global)


def _to(batch: TokenData, device) -> TokenData:
    return TokenData(*(getattr(batch, f).to(device) for f in _FIELDS))


def _gathered_head(engine, head_cfg) -> CorrectionHead:
    """A plain CPU copy of the engine's head with its full parameters (collective under ZeRO-3:
    every rank must call it)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        state = {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items()}
    head = CorrectionHead(head_cfg)
    head.load_state_dict(state)
    return head.eval()


def train_ranks(method: str, train: TokenData, val: TokenData, scfg, seed: int, ds_config: dict,
                backend: str) -> tuple[CorrectionHead, dict] | None:
    """Run on every rank of an already launched group (env ``RANK``/``WORLD_SIZE``/... set, or a
    process group already initialised, as under Ray Train). Returns ``(head, history)`` on rank 0,
    None elsewhere.

    Raises:
        FloatingPointError: a non-finite loss (on every rank: the check is on the reduced loss).
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    d = train.h_merged.shape[1]
    head = build_head(method, d, rank=scfg.rank, max_len=scfg.max_len, overflow=scfg.overflow, seed=seed)
    head_cfg = head.cfg
    mean_h = float(train.weight_source.float().mean())
    if not math.isfinite(mean_h) or mean_h <= 0:
        raise FloatingPointError(f"mean entropy of the calibration set is {mean_h}; cannot weight tokens")
    engine, _, _, _ = deepspeed.initialize(model=head, model_parameters=head.parameters(), config=ds_config)
    device = engine.device

    batches = batch_order(len(train), scfg.batch_size, scfg.epochs, seed)
    per_epoch = math.ceil(len(train) / scfg.batch_size)
    hist = {"mean_entropy": mean_h, "train_loss": [], "val": [evaluate_losses(None, val, mean_h, scfg.w_max)],
            "world_size": world, "zero_stage": int(ds_config.get("zero_optimization", {}).get("stage", 0))}
    engine.train()
    running = 0.0
    for i, idx in enumerate(batches):
        mine = torch.tensor_split(idx, world)[rank]  # this rank's slice of the global batch
        loss = slice_loss(engine, method, _to(train.select(mine), device), mean_h, scfg.w_max, len(idx), world)
        total = loss.detach().clone()
        dist.all_reduce(total)  # sum of shares = N * global loss
        glob = float(total) / world
        if not math.isfinite(glob):
            raise FloatingPointError(f"non-finite training loss {glob} ({method}, DeepSpeed step {i})")
        engine.backward(loss)
        engine.step()
        running += glob
        if (i + 1) % per_epoch == 0:
            hist["train_loss"].append(running / per_epoch)
            running = 0.0
            cur = _gathered_head(engine, head_cfg)
            hist["val"].append(evaluate_losses(cur, val, mean_h, scfg.w_max))
    final = _gathered_head(engine, head_cfg)
    hist["rank_max_abs_diff"] = _ranks_disagree(final, rank)
    _save_rank_copy(final, hist)
    return (final, hist) if rank == 0 else None


def _ranks_disagree(head: CorrectionHead, rank: int) -> float:
    """Max |difference| between this rank's final head and rank 0's, reduced (max) over all ranks,
    so every rank's copy is checked, not only the one rank 0 saves.

    Raises:
        RuntimeError: some rank holds different parameters (a broken data-parallel run).
    """
    import torch.distributed as dist

    flat = torch.cat([v.detach().float().flatten() for v in head.state_dict().values()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    worst = (flat - ref).abs().max().reshape(1) if flat.numel() else torch.zeros(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if float(worst) != 0.0:
        raise RuntimeError(f"DeepSpeed ranks ended with different heads (max |diff| {float(worst):.3e}, rank {rank})")
    return float(worst)


# ------------------------------------------------------------------------------ torchrun launcher
def _pack(train: TokenData, val: TokenData) -> dict[str, torch.Tensor]:
    return {f"{split}.{f}": getattr(data, f).contiguous() for split, data in (("train", train), ("val", val))
            for f in _FIELDS}


def _unpack(tensors: dict[str, torch.Tensor], split: str) -> TokenData:
    return TokenData(*(tensors[f"{split}.{f}"] for f in _FIELDS))


def _read_result(out_dir: Path) -> TrainResult:
    head = load_head(out_dir)
    hist = json.loads((out_dir / "head_config.json").read_text()).get("history", {})
    return TrainResult(head=head, history=hist)


_OP = "deepspeed_shm_comm"  # the C++ op DeepSpeed's CPU accelerator builds on its first init_distributed


def _log_start(ds_cfg, cuda: bool) -> None:
    """Say, before DeepSpeed starts, whether its first start will compile a C++ op (1-4 minutes on
    a small CPU machine, silent otherwise): built ops are cached in ``TORCH_EXTENSIONS_DIR``."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    if not cuda and not any(root.glob(f"**/{_OP}/*.so")):
        log.warning("DeepSpeed: first start here compiles its C++ op %s (1-4 min, needs g++); it is cached in "
                    "%s (TORCH_EXTENSIONS_DIR) for later runs", _OP, root)
    log.info("DeepSpeed: starting %d process(es), ZeRO %d, %s launcher", ds_cfg.num_procs, ds_cfg.zero_stage,
             ds_cfg.launcher)


def _run_torchrun(method: str, train: TokenData, val: TokenData, scfg, seed: int, ds_cfg, work_dir: Path,
                  cuda: bool) -> TrainResult:
    work_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"ds-{method}-", dir=work_dir))
    save_file(_pack(train, val), str(run_dir / "data.safetensors"))
    spec = {"method": method, "scfg": scfg.model_dump(mode="json"), "seed": seed,
            "ds_config": deepspeed_config(scfg, ds_cfg, ds_cfg.num_procs), "backend": "nccl" if cuda else "gloo",
            "data": str(run_dir / "data.safetensors"), "out_dir": str(run_dir / "out")}
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(ds_cfg.num_procs),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "darts_bench.surgery.train_deepspeed", "--spec", str(run_dir / "spec.json")]
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **_worker_env(cuda),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    log_path = run_dir / "launcher.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    log.info("DeepSpeed %s head (%d procs, ZeRO %d, torchrun): %.1f s", method, ds_cfg.num_procs,
             ds_cfg.zero_stage, time.perf_counter() - t0)
    err = run_dir / "out" / _ERROR_FILE
    if err.is_file():
        raise FloatingPointError(json.loads(err.read_text())["message"])
    if rc != 0:
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"DeepSpeed training ({' '.join(cmd)}) failed with exit code {rc}; "
                           f"log {log_path}:\n{tail}")
    res = _read_result(run_dir / "out")
    shutil.rmtree(run_dir, ignore_errors=True)  # kept only when the run failed, for its log
    return res


def main(argv: list[str] | None = None) -> int:
    """Entry point of each torchrun process: ``python -m darts_bench.surgery.train_deepspeed --spec spec.json``."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--spec", required=True, help="spec.json written by train_head_deepspeed")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = json.loads(Path(args.spec).read_text())
    if "RANK" not in os.environ:  # a plain `python -m` start: a group of one
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})
    import torch.distributed as dist

    from darts_bench.config import SurgeryConfig

    tensors = load_file(spec["data"])
    train, val = _unpack(tensors, "train"), _unpack(tensors, "val")
    scfg = SurgeryConfig.model_validate(spec["scfg"])
    out = Path(spec["out_dir"])
    rank = int(os.environ["RANK"])
    try:
        res = train_ranks(spec["method"], train, val, scfg, spec["seed"], spec["ds_config"], spec["backend"])
        dist.barrier()  # every rank is done with the group before any rank tears it down
    except FloatingPointError as e:
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / _ERROR_FILE).write_text(json.dumps({"type": "FloatingPointError", "message": str(e)}))
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if res is not None:
        head, hist = res
        save_head(head, out, extra={"history": hist})
    return 0


# ------------------------------------------------------------------------------ Ray Train launcher
def _ray_loop(config: dict) -> None:
    """``train_loop_per_worker`` of the TorchTrainer: Ray Train has set up the gloo/nccl group."""
    os.environ.update(config["env"])
    torch.set_num_threads(1)
    import ray
    import ray.train
    from ray.train import Checkpoint

    from darts_bench.config import SurgeryConfig

    arrays = ray.get(config["data"])
    with warnings.catch_warnings():  # object-store arrays are read-only; the features are only read
        warnings.simplefilter("ignore", UserWarning)
        tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    train, val = _unpack(tensors, "train"), _unpack(tensors, "val")
    scfg = SurgeryConfig.model_validate(config["scfg"])
    try:
        res = train_ranks(config["method"], train, val, scfg, config["seed"], config["ds_config"], config["backend"])
    except FloatingPointError as e:
        ray.train.report({"error": str(e)})
        return
    if res is None:
        ray.train.report({"ok": 1})
        return
    head, hist = res
    with tempfile.TemporaryDirectory() as d:
        save_head(head, Path(d), extra={"history": hist})
        ray.train.report({"ok": 1}, checkpoint=Checkpoint.from_directory(d))


def _run_ray(method: str, train: TokenData, val: TokenData, scfg, seed: int, ds_cfg, work_dir: Path, cuda: bool,
             ray_address: str | None) -> TrainResult:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from darts_bench.ray_instance import init_ray

    owns = init_ray(ray_address)  # no-op when this process is already connected (e.g. the Ray executor's)
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
        data = ray.put({k: v.numpy() for k, v in _pack(train, val).items()})
        config = {"method": method, "scfg": scfg.model_dump(mode="json"), "seed": seed, "env": _worker_env(cuda),
                  "ds_config": deepspeed_config(scfg, ds_cfg, ds_cfg.num_procs),
                  "backend": "nccl" if cuda else "gloo", "data": data}
        name = f"ds-{method}-{seed}-{os.getpid()}-{time.time_ns()}"
        storage = work_dir.resolve() / "ray_train"
        trainer = TorchTrainer(_ray_loop, train_loop_config=config,
                               torch_config=TorchConfig(backend="nccl" if cuda else "gloo"),
                               scaling_config=ScalingConfig(num_workers=ds_cfg.num_procs, use_gpu=cuda),
                               run_config=RunConfig(name=name, storage_path=str(storage)))
        t0 = time.perf_counter()
        result = trainer.fit()
        log.info("DeepSpeed %s head (%d procs, ZeRO %d, Ray Train): %.1f s", method, ds_cfg.num_procs,
                 ds_cfg.zero_stage, time.perf_counter() - t0)
        metrics = result.metrics or {}
        if "error" in metrics:
            raise FloatingPointError(metrics["error"])
        if result.checkpoint is None:
            raise RuntimeError(f"Ray Train run {name} returned no checkpoint (metrics {metrics})")
        with result.checkpoint.as_directory() as d:
            res = _read_result(Path(d))
        shutil.rmtree(storage / name, ignore_errors=True)  # the checkpoint is read; keep nothing behind
        with contextlib.suppress(OSError):
            storage.rmdir()
        return res
    finally:
        if owns:
            ray.shutdown()


# ------------------------------------------------------------------------------ public API
def train_head_deepspeed(method: str, train: TokenData, val: TokenData, scfg, seed: int, ds_cfg,
                         work_dir: Path, ray_address: str | None = None) -> TrainResult:
    """Train one head under DeepSpeed; same contract and (within float tolerance) same result as
    :func:`darts_bench.surgery.train.train_head`.

    Args:
        method, train, val, scfg, seed: as :func:`train_head`.
        ds_cfg: :class:`darts_bench.config.DeepSpeedConfig` (num_procs, zero_stage, launcher, extra).
        work_dir: scratch dir for the launcher (features as safetensors, logs, Ray Train storage).
        ray_address: Ray cluster to join for ``launcher: ray`` when Ray is not initialised yet
            (None: a local instance on 127.0.0.1, shut down again afterwards). On a multi-node
            cluster ``work_dir`` must be on storage every node sees (Ray Train writes the trained
            head there as a checkpoint).
    Returns:
        the trained head (eval mode, CPU) and its history (per-epoch train loss, validation L1 /
        entropy-weighted L1 before training and after each epoch, world size, ZeRO stage, and
        ``rank_max_abs_diff``: 0.0, every rank's final head checked against rank 0's).
    Raises:
        FloatingPointError: non-finite loss or calibration entropy; RuntimeError: the launch failed
        or the ranks ended with different heads.
    """
    if method not in METHODS:
        raise ValueError(f"unknown correction method {method!r}; known: {sorted(METHODS)}")
    mean_h = float(train.weight_source.float().mean())
    if not math.isfinite(mean_h) or mean_h <= 0:
        raise FloatingPointError(f"mean entropy of the calibration set is {mean_h}; cannot weight tokens")
    cuda = _use_cuda()
    work_dir = Path(work_dir)
    _log_start(ds_cfg, cuda)
    if ds_cfg.launcher == "ray":
        return _run_ray(method, train, val, scfg, seed, ds_cfg, work_dir, cuda, ray_address)
    return _run_torchrun(method, train, val, scfg, seed, ds_cfg, work_dir, cuda)


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: everything a rank produces is written (and its process group
    # destroyed) by now. Once in ~30 two-process launches (2026-12-04) a rank aborted after a complete run, in
    # teardown ("terminate called without an active exception", exit -6: a C++ thread object destroyed while
    # still joinable; whether in destroy_process_group or in exit-time destructors was not pinned down), and
    # torchrun reported the training as failed. The barrier above covers the first, this the second. Python's
    # own buffers are flushed first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
