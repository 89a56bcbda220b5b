"""DeepSpeed head training matches the in-process trainer (same head, batches, Adam, loss).

The first DeepSpeed start on a machine compiles a C++ comm op (about a minute); it is cached in
``TORCH_EXTENSIONS_DIR`` (``<repo>/.cache/torch_extensions`` unless set), so later runs skip it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

pytest.importorskip("deepspeed")

from darts_bench.config import DeepSpeedConfig, SurgeryConfig  # noqa: E402
from darts_bench.surgery.heads import METHODS, build_head  # noqa: E402
from darts_bench.surgery.train import TokenData, batch_order, head_loss, train_head  # noqa: E402
from darts_bench.surgery.train_deepspeed import deepspeed_config, slice_loss, train_head_deepspeed  # noqa: E402

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


def test_nan_loss_raises_floating_point_error(tmp_path):
    train, val = synthetic(128), synthetic(32, seed=1)
    train.h_merged[5, 3] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite training loss"):
        train_head_deepspeed("darts", train, val, SCFG, SEED, DeepSpeedConfig(enabled=True, num_procs=1), tmp_path)


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
