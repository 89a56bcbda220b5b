"""Tests against independent references (issue "Paper scale, rehearsed", tests that can fail):

* the DARTS loss against a value computed by hand (a DARTS trained with plain L1 fails here);
* KV-cached, batched, left-padded generation with a head against a loop that recomputes the whole
  sequence without cache or padding and applies the head at the last absolute position by hand;
* Ray retries counted: how many times each shard started and finished when an actor is killed.

Runs after test_ray_executor.py (file order) and shares the run's Ray instance (conftest).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from darts_bench.surgery.heads import build_head
from darts_bench.surgery.train import TokenData, head_loss

# ------------------------------------------------------------------- the DARTS loss, by hand
# three tokens, d = 2; the heads start as the identity (W_up = 0, bias = 0), so h' = h_merged
H_MERGED = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]])
H_EXPERT = torch.tensor([[0.0, 0.0], [1.0, -1.0], [0.0, 1.0]])
ENTROPY = torch.tensor([1.0, 2.0, 6.0])  # nats; mean_H = 3 over the calibration set
# per-token L1 = mean_d |h - h_e| = 1.5, 1, 2; weights min(H / 3, 1.5) = 1/3, 2/3, 1.5
PLAIN = (1.5 + 1.0 + 2.0) / 3  # 1.5
WEIGHTED = (1.5 / 3 + 1.0 * 2 / 3 + 2.0 * 1.5) / 3  # 25/18


@pytest.mark.parametrize("method,want", [("surgery", PLAIN), ("darts", WEIGHTED), ("darts_ew_only", WEIGHTED),
                                         ("darts_pos_only", PLAIN)])
def test_head_loss_equals_the_hand_computed_value(method, want):
    data = TokenData(H_MERGED, H_EXPERT, torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.long), ENTROPY)
    head = build_head(method, 2, rank=2, max_len=4, seed=0)
    assert head_loss(head, data, mean_h=3.0, w_max=1.5).item() == pytest.approx(want, abs=1e-6)
    assert WEIGHTED == pytest.approx(25 / 18)


def test_darts_training_minimises_the_weighted_loss_not_plain_l1():
    """One Adam step on the DARTS bias moves each row by the sign of its weighted gradient; with a
    zero weight on a token (entropy 0) its position's row must not move at all."""
    data = TokenData(H_MERGED, H_EXPERT, torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.long),
                     torch.tensor([0.0, 3.0, 6.0]))
    head = build_head("darts", 2, rank=2, max_len=4, seed=0)
    opt = torch.optim.SGD(head.parameters(), lr=1.0)
    head_loss(head, data, mean_h=3.0, w_max=1.5).backward()
    g = head.pos_bias.grad  # d/db_p of sum_i w_i mean_d |h_i + b_p - h_e,i| / 3
    assert torch.equal(g[0], torch.zeros(2))  # w_0 = 0
    # token 1: w = 1, sign(h - h_e) = (-1, +1) -> grad (-1, 1) / (2 * 3); token 2: w = 1.5, sign (+1, -1)
    assert torch.allclose(g[1], torch.tensor([-1.0, 1.0]) / 6)
    assert torch.allclose(g[2], torch.tensor([1.5, -1.5]) / 6)
    opt.zero_grad()


# ------------------------------------------------------ generation vs a no-cache reference
def _reference_greedy(model, head, prompt: list[int], n_new: int, eos: set[int]) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each step (no KV cache, no padding, batch
    of one) and applying ``head`` by hand to the final hidden state at the last absolute position."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            h = model.model(input_ids=torch.tensor([seq]), use_cache=False).last_hidden_state[0, -1]  # [d]
            h = head(h[None], torch.tensor([len(seq) - 1]))[0]
            t = int(model.lm_head(h).argmax())
            if t in eos:
                break
            seq.append(t)
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    from test_ray_executor import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("gen") / "model", hidden=32, layers=2, vocab=300, seed=5)


@pytest.mark.parametrize("method", ["darts", "surgery"])
def test_cached_batched_generation_with_a_head_matches_the_no_cache_loop(tiny_ckpt, method):
    from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm

    head = build_head(method, 32, rank=4, max_len=24, seed=2)  # positions past 24 exercise the clamp
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head.up.weight.copy_(torch.randn(head.up.weight.shape, generator=g))
        if head.pos_bias is not None:
            head.pos_bias.copy_(2.0 * torch.randn(head.pos_bias.shape, generator=g))
    plain, tok = load_causal_lm(tiny_ckpt)
    eos = {plain.generation_config.eos_token_id}
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 290, (n,), generator=gen).tolist() for n in (3, 17, 9, 22, 1)]
    want = [_reference_greedy(plain, head, p, 10, eos) for p in prompts]
    no_head = [_reference_greedy(plain, build_head(method, 32, rank=4, max_len=24, seed=2), p, 10, eos)
               for p in prompts]
    assert want != no_head  # the head changes the output, so the comparison below can fail
    model, tok = load_causal_lm(tiny_ckpt)
    tm = HFTextModel("m", model, tok, head=head, batch_size=3)  # batches of 3 and 2, left-padded
    try:
        got = [s[0] for s in tm.generate_ids(prompts, max_new_tokens=10)]
    finally:
        tm.close()
    assert got == want


# ------------------------------------------------------------- Ray: executions counted
def counting_worker():
    """A ModelWorker that records every start and finish of a shard as a file in ``count_dir`` and
    exits its process on the first attempt at the shard named ``crash_shard`` (defined in a function
    so that Ray ships it by value)."""
    from darts_bench.executors.worker import ModelWorker

    class CountingWorker(ModelWorker):
        def run(self, op, payload):
            d, i = Path(payload["count_dir"]), payload["shard"]
            (d / f"start-{i}-{uuid.uuid4().hex}").write_text(str(os.getpid()))
            if i == payload.get("crash_shard") and not list(d.glob(f"crashed-{i}")):
                (d / f"crashed-{i}").write_text(str(os.getpid()))
                os._exit(1)
            res = super().run(op, {"sequences": payload["sequences"]})
            (d / f"done-{i}-{uuid.uuid4().hex}").write_text(str(os.getpid()))
            return res

    return CountingWorker


@pytest.mark.ray
@pytest.mark.timeout(400)
@pytest.mark.parametrize("max_restarts", [1, 0], ids=["ray-restarts-actor", "driver-resubmits"])
def test_killed_actor_reruns_only_its_shard_once(tiny_ckpt, ray_instance, tmp_path, max_restarts):
    from test_ray_executor import assert_same_features, feature_payloads, local_features, make_cfg

    from darts_bench.executors.ray_executor import RayExecutor

    payloads = feature_payloads(tiny_ckpt)
    want = local_features(tiny_ckpt, payloads)
    counted = [{**p, "count_dir": str(tmp_path), "shard": i, "crash_shard": 1} for i, p in enumerate(payloads)]
    ex = RayExecutor(make_cfg(max_restarts=max_restarts, max_task_retries=1), worker_cls=counting_worker())
    try:
        got = ex.map(str(tiny_ckpt), "features", counted)
    finally:
        ex.close()
    assert_same_features(got, want)

    def count(kind: str, i: int) -> int:
        return len(list(tmp_path.glob(f"{kind}-{i}-*")))

    assert (count("start", 1), count("done", 1)) == (2, 1)  # killed once, rerun once
    for i in (0, 2):
        assert (count("start", i), count("done", i)) == (1, 1)  # never rerun
