"""DeepSpeed head training matches the in-process trainer (same head, batches, Adam, loss).

The first DeepSpeed start on a machine compiles a C++ comm op (about a minute); it is cached in
``TORCH_EXTENSIONS_DIR`` (``<repo>/.cache/torch_extensions`` unless set), so later runs skip it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

pytest.importorskip("deepspeed")

from darts_bench.config import DeepSpeedConfig, SurgeryConfig  # noqa: E402
from darts_bench.surgery.heads import METHODS, build_head  # noqa: E402
from darts_bench.surgery.train import TokenData, batch_order, evaluate_losses, head_loss, train_head  # noqa: E402
from darts_bench.surgery.train_deepspeed import deepspeed_config, slice_loss, train_head_deepspeed  # noqa: E402

pytestmark = [pytest.mark.deepspeed, pytest.mark.subprocess]  # tests/README.md: markers

SCFG = SurgeryConfig(methods=["darts"], rank=4, max_len=32, epochs=3, batch_size=64, lr=1e-3)
SEED = 7


def synthetic(n: int, d: int = 16, seed: int = 0) -> TokenData:
    """Merged features = expert features + a position-dependent shift + noise; entropies in (0, 3)."""
    g = torch.Generator().manual_seed(seed)
    he = torch.randn(n, d, generator=g)
    pos = torch.randint(0, 40, (n,), generator=g)  # some positions past max_len=32 (clamp)
    hm = he + 0.05 * pos.float().unsqueeze(-1) / 40 + 0.3 * torch.randn(n, d, generator=g)
    return TokenData(hm, he, pos, torch.arange(n) // 32, torch.rand(n, generator=g) * 3 + 1e-3)


def assert_same(ref, got, atol=1e-5):
    want, have = ref.head.state_dict(), got.head.state_dict()
    assert want.keys() == have.keys()
    for k in want:
        assert torch.allclose(want[k], have[k], atol=atol, rtol=0), (k, (want[k] - have[k]).abs().max().item())
    assert got.head.cfg == ref.head.cfg and not got.head.training
    assert got.history["rank_max_abs_diff"] == 0.0  # every rank ended with the head rank 0 saved
    assert got.history["train_loss"] == pytest.approx(ref.history["train_loss"], abs=1e-6)
    assert len(got.history["val"]) == len(ref.history["val"]) == SCFG.epochs + 1
    for a, b in zip(ref.history["val"], got.history["val"]):
        assert b == pytest.approx(a, abs=1e-5)
    # it trained: the validation loss went down from the identity head's
    assert got.history["val"][-1]["l1_ew"] < got.history["val"][0]["l1_ew"]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_slice_shares_sum_to_the_global_loss(method):
    """The per-rank shares of any split (uneven, empty) average to the in-process batch loss."""
    data = synthetic(53)
    head = build_head(method, 16, rank=4, max_len=32, seed=1)
    with torch.no_grad():
        head.up.weight.normal_()
        if head.pos_bias is not None:
            head.pos_bias.normal_()
    want = head_loss(head, data, 1.3, 2.0)
    for world in (1, 2, 3, 60):
        parts = torch.tensor_split(torch.arange(53), world)
        shares = [slice_loss(head, method, data.select(p), 1.3, 2.0, 53, world) for p in parts]
        assert (sum(shares) / world).item() == pytest.approx(want.item(), rel=1e-6)


def test_deepspeed_config_uses_torch_adam_and_splits_the_batch():
    ds = DeepSpeedConfig(enabled=True, num_procs=2, zero_stage=3,
                         extra={"zero_optimization": {"overlap_comm": False}, "gradient_clipping": 1.0})
    cfg = deepspeed_config(SCFG.model_copy(update={"weight_decay": 0.01}), ds, 2)
    assert cfg["optimizer"]["type"] == "Adam"
    assert cfg["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                          "torch_adam": True, "adam_w_mode": False}
    assert cfg["train_micro_batch_size_per_gpu"] == 32 and cfg["gradient_accumulation_steps"] == 1
    assert cfg["train_batch_size"] == SCFG.batch_size
    assert cfg["zero_optimization"] == {"stage": 3, "overlap_comm": False}  # extra merged, not replaced
    assert cfg["gradient_clipping"] == 1.0


def assert_all_ranks(ranks_dir: Path, ref, procs: int) -> None:
    """Every rank ended with the in-process head and history, not only rank 0."""
    from darts_bench.surgery.train import TrainResult
    from darts_bench.surgery.train_deepspeed import _read_result

    found = sorted(p.name for p in ranks_dir.iterdir())
    assert found == [f"rank-{r}" for r in range(procs)]
    for r in range(procs):
        res = _read_result(ranks_dir / f"rank-{r}")
        assert_same(ref, TrainResult(head=res.head, history=res.history))


@pytest.mark.parametrize("procs,stage,n_train", [
    (1, 2, 512),
    (2, 2, 501),  # 7 full batches + a short one of 53 tokens, split 27 / 26
    (2, 3, 512),
])
def test_torchrun_matches_in_process(tmp_path, procs, stage, n_train, monkeypatch):
    train, val = synthetic(n_train, seed=0), synthetic(128, seed=1)
    assert n_train % SCFG.batch_size == 0 or len(batch_order(n_train, 64, 1, SEED)[-1]) == 53
    ref = train_head("darts", train, val, SCFG, SEED)
    ranks = tmp_path.parent / f"{tmp_path.name}-ranks"
    monkeypatch.setenv("DARTS_BENCH_DS_RANKS_DIR", str(ranks))
    got = train_head_deepspeed("darts", train, val, SCFG, SEED,
                               DeepSpeedConfig(enabled=True, num_procs=procs, zero_stage=stage), tmp_path)
    assert_same(ref, got)
    assert_all_ranks(ranks, ref, procs)
    assert got.history["world_size"] == procs and got.history["zero_stage"] == stage
    assert not any(tmp_path.iterdir()), "the launcher's scratch dir is removed after a successful run"


def split_arithmetic(method: str, train: TokenData, scfg, seed: int, world: int):
    """DeepSpeed's arithmetic without DeepSpeed: every global batch split as the ranks split it,
    each slice's gradient of ``slice_loss`` taken on its own, averaged, then torch's Adam step."""
    head = build_head(method, train.h_merged.shape[1], rank=scfg.rank, max_len=scfg.max_len,
                      overflow=scfg.overflow, seed=seed)
    mean_h = float(train.weight_source.float().mean())
    opt = torch.optim.Adam(head.parameters(), lr=scfg.lr, weight_decay=scfg.weight_decay)
    params = list(head.parameters())
    head.train()
    for idx in batch_order(len(train), scfg.batch_size, scfg.epochs, seed):
        grads = [torch.zeros_like(p) for p in params]
        for mine in torch.tensor_split(idx, world):
            loss = slice_loss(head, method, train.select(mine), mean_h, scfg.w_max, len(idx), world)
            for g, x in zip(grads, torch.autograd.grad(loss, params, allow_unused=True)):
                if x is not None:
                    g += x
        for p, g in zip(params, grads):
            p.grad = g / world
        opt.step()
    return head.eval()


@pytest.mark.parametrize("procs", [1, 2])
def test_torchrun_at_the_configs_epoch_count(tmp_path, procs):
    """At the configs' 40 epochs. One process: bitwise the in-process head. Two processes:
    bitwise the same split arithmetic done in one process (so DeepSpeed adds nothing of its own:
    same Adam, eps, ZeRO partitioning, averaging), while the in-process head, which sums each
    batch's gradient in one piece, is only equal within the stated bound (README, "Guarantees"):
    float32 summation order decides where an L1 residual's sign flips and Adam amplifies that."""
    scfg = SCFG.model_copy(update={"epochs": 40})
    train, val = synthetic(512, seed=0), synthetic(128, seed=1)
    ref = train_head("darts", train, val, scfg, SEED)
    got = train_head_deepspeed("darts", train, val, scfg, SEED,
                               DeepSpeedConfig(enabled=True, num_procs=procs, zero_stage=2), tmp_path)
    assert got.history["rank_max_abs_diff"] == 0.0 and got.history["world_size"] == procs
    emu = split_arithmetic("darts", train, scfg, SEED, procs)
    for k, v in emu.state_dict().items():
        assert torch.equal(got.head.state_dict()[k], v), (k, (got.head.state_dict()[k] - v).abs().max().item())
    for k, v in ref.head.state_dict().items():
        d = (got.head.state_dict()[k] - v).abs().max().item()
        assert d == 0.0 if procs == 1 else d <= 5e-2, (k, d)
    mean_h = float(train.weight_source.mean())
    l_ref = evaluate_losses(ref.head, val, mean_h, scfg.w_max)["l1_ew"]
    l_got = evaluate_losses(got.head, val, mean_h, scfg.w_max)["l1_ew"]
    assert abs(l_got - l_ref) <= 1e-4 * l_ref


def test_nan_loss_raises_floating_point_error(tmp_path):
    train, val = synthetic(128), synthetic(32, seed=1)
    train.h_merged[5, 3] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite training loss"):
        train_head_deepspeed("darts", train, val, SCFG, SEED, DeepSpeedConfig(enabled=True, num_procs=1), tmp_path)


@pytest.mark.ray
def test_ray_train_launcher_matches_in_process(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.train.torch")
    if ray.is_initialized():
        pytest.skip("Ray already initialised in this process")
    train, val = synthetic(512), synthetic(128, seed=1)
    ref = train_head("darts", train, val, SCFG, SEED)
    ranks = tmp_path.parent / f"{tmp_path.name}-ranks"
    monkeypatch.setenv("DARTS_BENCH_DS_RANKS_DIR", str(ranks))
    got = train_head_deepspeed("darts", train, val, SCFG, SEED,
                               DeepSpeedConfig(enabled=True, num_procs=2, zero_stage=2, launcher="ray"), tmp_path)
    assert_all_ranks(ranks, ref, 2)
    assert not ray.is_initialized(), "a Ray instance the trainer started is shut down again"
    assert not any(tmp_path.iterdir()), "the Ray Train run dir is removed once the head is read"
    assert_same(ref, got)
    assert got.history["world_size"] == 2


@pytest.mark.micro
def test_deepspeed_then_in_process_heads_are_both_kept(micro_pipeline, micro_cfg_path, monkeypatch):
    """DeepSpeed settings are in the head key: a DeepSpeed run and an in-process run in one work
    dir give two head artifacts, both kept and each served to its own kind of run."""
    from darts_bench.artifacts import verify
    from darts_bench.config import load_config
    from darts_bench.pipeline import Pipeline
    from darts_bench.surgery import train_deepspeed

    over = ["merges=[{name: ties, method: ties, density: 0.5, normalize: true}]",
            "calibration.splits=[transductive]", "surgery.methods=[darts]"]
    ds_over = [*over, "deepspeed.enabled=true", "deepspeed.num_procs=2"]
    k = ("ties", "gsm8k", "darts", "transductive")
    h_ds = Pipeline(load_config(str(micro_cfg_path), ds_over), suite="gsm8k").train()["heads"][k]
    h_in = Pipeline(load_config(str(micro_cfg_path), over), suite="gsm8k").train()["heads"][k]
    assert h_ds.parent != h_in.parent
    assert verify(h_ds.parent) is None and verify(h_in.parent) is None
    hist_ds = json.loads((h_ds / "head_config.json").read_text())["history"]
    hist_in = json.loads((h_in / "head_config.json").read_text())["history"]
    assert hist_ds["world_size"] == 2 and hist_ds["rank_max_abs_diff"] == 0.0 and "world_size" not in hist_in

    def boom(*a, **kw):
        raise AssertionError("DeepSpeed launched although its head is cached")

    monkeypatch.setattr(train_deepspeed, "train_head_deepspeed", boom)
    assert Pipeline(load_config(str(micro_cfg_path), ds_over), suite="gsm8k").train()["heads"][k] == h_ds


def test_op_compile_is_announced_before_it_starts(tmp_path, monkeypatch, caplog):
    """Without a built ``deepspeed_shm_comm`` under TORCH_EXTENSIONS_DIR the launcher warns that
    the first start compiles it; with one there, it only logs the start."""
    import logging

    from darts_bench.surgery import train_deepspeed as tds

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ds = DeepSpeedConfig(enabled=True, num_procs=2)
    with caplog.at_level(logging.INFO, logger="darts_bench"):
        tds._log_start(ds, cuda=False)
    assert any(r.levelno == logging.WARNING and "compiles its C++ op deepspeed_shm_comm" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    with caplog.at_level(logging.INFO, logger="darts_bench"):
        tds._log_start(ds, cuda=False)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "starting 2 process(es), ZeRO 2, torchrun launcher" in caplog.records[0].getMessage()
