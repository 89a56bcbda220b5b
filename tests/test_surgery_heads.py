import pytest
import torch

from darts_bench.surgery.heads import build_head, load_head, positions_from_mask, save_head
from darts_bench.surgery.losses import entropy_weights, kl_divergence, l1_loss, next_token_entropy, weighted_l1_loss
from darts_bench.surgery.train import TokenData, train_head


def test_l1_loss_hand_computed():
    h = torch.tensor([[[1.0, 2.0], [0.0, 0.0]]])  # [1, 2, 2]
    he = torch.tensor([[[0.0, 0.0], [1.0, 3.0]]])
    # per-token mean_d |.|: token0 = (1+2)/2 = 1.5, token1 = (1+3)/2 = 2
    assert l1_loss(h, he).item() == pytest.approx(1.75)
    assert l1_loss(h, he, torch.tensor([[1, 0]])).item() == pytest.approx(1.5)


def test_weighted_l1_hand_computed():
    h = torch.tensor([[1.0, 2.0], [0.0, 0.0], [2.0, 2.0]])
    he = torch.zeros(3, 2)
    ent = torch.tensor([1.0, 3.0, 8.0])  # mean 4 -> w = [0.25, 0.75, min(2, 1.5)=1.5]
    w = entropy_weights(ent, 4.0, 1.5)
    assert w.tolist() == pytest.approx([0.25, 0.75, 1.5])
    # sum_i w_i * l1_i / n = (0.25*1.5 + 0.75*0 + 1.5*2) / 3
    assert weighted_l1_loss(h, he, w).item() == pytest.approx((0.375 + 3.0) / 3)
    mask = torch.tensor([1, 1, 0])
    assert weighted_l1_loss(h, he, w, mask).item() == pytest.approx(0.375 / 2)
    with pytest.raises(ValueError):
        entropy_weights(ent, 0.0, 5.0)


def test_entropy_and_kl_nats():
    logits = torch.zeros(4)  # uniform over 4 -> ln 4
    assert next_token_entropy(logits).item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    p = torch.log(torch.tensor([0.5, 0.5]))
    q = torch.log(torch.tensor([0.9, 0.1]))
    expect = 0.5 * (torch.log(torch.tensor(0.5 / 0.9)) + torch.log(torch.tensor(0.5 / 0.1)))
    assert kl_divergence(p, q).item() == pytest.approx(expect.item(), rel=1e-5)


@pytest.mark.parametrize("method", ["surgery", "darts", "darts_ew_only", "darts_pos_only"])
def test_head_is_identity_at_init(method):
    head = build_head(method, 8, rank=4, max_len=16, seed=3)
    h = torch.randn(2, 5, 8)
    pos = torch.arange(5).expand(2, 5)
    assert torch.equal(head(h, pos), h)


def test_positions_from_left_padded_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_overflow_policies():
    d = 2
    for policy in ("clamp", "zero", "bucket"):
        head = build_head("darts_pos_only", d, rank=1, max_len=4, overflow=policy)
        with torch.no_grad():
            head.pos_bias.copy_(torch.arange(head.pos_bias.shape[0], dtype=torch.float32)[:, None].expand(-1, d))
        h = torch.zeros(1, 8, d)
        pos = torch.arange(8)[None]
        out = head(h, pos)[0, :, 0].tolist()
        assert out[:4] == [0, 1, 2, 3]
        if policy == "clamp":
            assert out[4:] == [3, 3, 3, 3]
        elif policy == "zero":
            assert out[4:] == [0, 0, 0, 0]
        else:  # bucket rows 4 + floor(log2(pos - 4 + 1)): pos 4 -> 4, 5 -> 5, 6 -> 5, 7 -> 6
            assert out[4:] == [4, 5, 5, 6]


def test_darts_needs_positions():
    head = build_head("darts", 4, rank=2)
    with pytest.raises(ValueError, match="positions"):
        head(torch.zeros(1, 4))


def test_save_load_roundtrip(tmp_path):
    head = build_head("darts", 6, rank=3, max_len=8, seed=1)
    with torch.no_grad():
        head.up.weight.normal_()
        head.pos_bias.normal_()
    save_head(head, tmp_path / "h")
    back = load_head(tmp_path / "h")
    x, pos = torch.randn(3, 6), torch.tensor([0, 5, 9])
    assert torch.equal(back(x, pos), head(x, pos))
    with pytest.raises(FileNotFoundError):
        load_head(tmp_path / "missing")


def _toy_data(n=512, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    hm = torch.randn(n, d, generator=g)
    pos = torch.randint(0, 32, (n,), generator=g)
    he = hm * 0.7 + 0.05 * pos[:, None].float() / 32  # a low-rank-ish shrink plus a position drift
    ent = torch.rand(n, generator=g) * 3
    return TokenData(hm, he, pos, torch.arange(n) // 16, ent)


def test_training_lowers_loss_and_is_seeded():
    from darts_bench.config import SurgeryConfig

    cfg = SurgeryConfig(epochs=5, batch_size=64, rank=4, max_len=32)
    data = _toy_data()
    tr = data.select(torch.arange(0, 384))
    va = data.select(torch.arange(384, 512))
    r1 = train_head("darts", tr, va, cfg, seed=7)
    r2 = train_head("darts", tr, va, cfg, seed=7)
    assert r1.history["val"][-1]["l1_ew"] < r1.history["val"][0]["l1_ew"]
    for (k, a), (_, b) in zip(r1.head.state_dict().items(), r2.head.state_dict().items()):
        assert torch.equal(a, b), k
