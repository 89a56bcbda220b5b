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


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("overflow", ["clamp", "zero", "bucket"])
def test_position_bias_gradient_is_the_token_order_sum_with_two_threads(two_threads, overflow):
    """A batch of 4,096 tokens over 100 positions (d 256: 1M gradient elements, past the 32,768 at
    which indexing's backward went to parallel atomic adds): the bias table's gradient is the
    per-row sum in token order, bitwise, every time."""
    g = torch.Generator().manual_seed(3)
    n, d, L = 4096, 256, 64
    head = build_head("darts", d, rank=4, max_len=L, overflow=overflow, seed=0)
    pos = torch.randint(0, 100, (n,), generator=g)
    grad_out = torch.randn(n, d, generator=g)
    idx, keep = head.bias_index(pos)
    want = torch.zeros_like(head.pos_bias)
    for i in range(n):  # the sum in token order, one token at a time
        want[idx[i]] += grad_out[i] * keep[i]
    for _ in range(3):
        head.zero_grad(set_to_none=True)
        head(torch.zeros(n, d), pos).backward(grad_out)
        assert torch.equal(head.pos_bias.grad, want)


def test_darts_head_trained_with_one_or_two_threads_is_bitwise_the_same():
    """``train_head`` at torch 1 and 2 threads: the same DARTS head bit for bit (batches of 256
    tokens x d 256, repeated positions; before the fix the bias table differed at 2 threads)."""
    from darts_bench.config import SurgeryConfig

    g = torch.Generator().manual_seed(5)
    n, d = 2048, 256
    hm = torch.randn(n, d, generator=g)
    data = TokenData(hm, hm + 0.1 * torch.randn(n, d, generator=g), torch.arange(n) % 128, torch.arange(n) // 128,
                     torch.rand(n, generator=g) * 3)
    tr, va = data.select(torch.arange(0, 1536)), data.select(torch.arange(1536, n))
    cfg = SurgeryConfig(epochs=3, batch_size=256, rank=8, max_len=128)
    before = torch.get_num_threads()
    heads = []
    try:
        for t in (1, 2, 2):
            torch.set_num_threads(t)
            heads.append(train_head("darts", tr, va, cfg, seed=0).head.state_dict())
    finally:
        torch.set_num_threads(before)
    for other in heads[1:]:
        for k in heads[0]:
            assert torch.equal(heads[0][k], other[k]), k


@pytest.mark.parametrize("overflow", ["clamp", "zero", "bucket"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("L", [96, 160])
def test_training_only_the_bias_rows_in_use_gives_the_whole_table_head_bitwise(two_threads, overflow, weight_decay, L,
                                                                               monkeypatch):
    """``train_head`` optimises only the first rows of a DARTS position table that its training and held-out
    tokens index (``bias_rows_in_use``): the trained head, its history and the rows left at zero are bitwise
    those of Adam over the whole table, with and without weight decay, under every overflow policy. Training
    positions 0..63, held-out 0..127: with ``max_len`` 160 the first 128 rows are trained (the held-out tokens'
    rows past the training ones' are zero but inside the trained block); with 96 the held-out tokens pass
    ``max_len`` (``clamp`` / ``zero``: its last row, the whole table; ``bucket``: a bucket row, 6 of 16)."""
    import contextlib

    import darts_bench.surgery.train as train_mod
    from darts_bench.config import SurgeryConfig

    g = torch.Generator().manual_seed(11)
    n, d = 1536, 64
    hm = torch.randn(n, d, generator=g)
    # training sequences of 64 tokens (positions 0..63); held-out ones of 128 (clamp / zero: past max_len 96)
    pos = torch.cat([torch.arange(1024) % 64, torch.arange(512) % 128])
    data = TokenData(hm, hm + 0.1 * torch.randn(n, d, generator=g), pos, torch.arange(n) // 64,
                     torch.rand(n, generator=g) * 3)
    tr, va = data.select(torch.arange(0, 1024)), data.select(torch.arange(1024, n))
    cfg = SurgeryConfig(epochs=3, batch_size=128, rank=4, max_len=L, overflow=overflow, weight_decay=weight_decay)
    used: list = []
    real = train_mod.bias_rows_in_use

    @contextlib.contextmanager
    def spy(head, *positions):
        with real(head, *positions) as rows:
            used.append((rows, None if head.pos_bias is None else tuple(head.pos_bias.shape)))
            yield rows

    monkeypatch.setattr(train_mod, "bias_rows_in_use", spy)
    fast = train_head("darts", tr, va, cfg, seed=3)
    monkeypatch.setattr(train_mod, "bias_rows_in_use", lambda head, *p: contextlib.nullcontext(None))
    whole = train_head("darts", tr, va, cfg, seed=3)
    # bucket at 96: position 127 -> row 96 + floor(log2(127 - 96 + 1)) = 101, so 102 rows
    rows = 128 if L == 160 else {"clamp": L, "zero": L, "bucket": L + 6}[overflow]
    assert used == [(rows, (rows, d))]
    assert fast.head.pos_bias.shape == whole.head.pos_bias.shape
    assert fast.history == whole.history
    for k, v in whole.head.state_dict().items():
        assert torch.equal(fast.head.state_dict()[k], v), k
    assert not fast.head.pos_bias[rows:].any() and fast.head.pos_bias[:64].abs().sum(1).gt(0).all()
    # a Surgery head has no table: nothing changes
    monkeypatch.setattr(train_mod, "bias_rows_in_use", spy)
    used.clear()
    train_head("surgery", tr, va, cfg.model_copy(update={"epochs": 1}), seed=3)
    assert used == [(None, None)]


def test_bias_rows_in_use_refuses_a_table_whose_untrained_rows_are_not_zero():
    """The rows the optimiser does not see must be zero (what ``build_head`` makes), else the shortcut would leave
    rows Adam's weight decay moves: a clear error, and the head keeps its whole table."""
    from darts_bench.surgery.train import bias_rows_in_use

    head = build_head("darts", 8, rank=2, max_len=16, seed=0)
    with torch.no_grad():
        head.pos_bias[10].fill_(1.0)
    with pytest.raises(ValueError, match="rows 4.. of the position-bias table are not zero"):
        with bias_rows_in_use(head, torch.arange(4)):
            pass
    assert head.pos_bias.shape == (16, 8) and head.pos_bias[10].eq(1).all()
    with bias_rows_in_use(head, torch.arange(12), torch.arange(3)) as rows:
        assert rows == 12 and head.pos_bias.shape == (12, 8)
        with torch.no_grad():
            head.pos_bias[0].fill_(2.0)
    assert head.pos_bias.shape == (16, 8) and head.pos_bias[0].eq(2).all() and head.pos_bias[10].eq(1).all()


@pytest.mark.parametrize("method", ["surgery", "darts", "darts_ew_only", "darts_pos_only"])
@pytest.mark.parametrize("overflow", ["clamp", "zero", "bucket"])
def test_head_param_count_equals_built_heads(method, overflow):
    """darts_bench.controls.head_param_count (no torch, the planner's) counts what a built head holds."""
    from darts_bench.controls import head_param_count

    for d, r, L in ((16, 4, 7), (128, 16, 301), (576, 16, 1184)):
        head = build_head(method, d, rank=r, max_len=L, overflow=overflow)
        assert head_param_count(method, d, r, L, overflow) == head.num_parameters()


def test_param_matched_surgery_within_ten_percent_of_darts():
    """The matched Surgery head's exact parameter count (a built head) is within 10% of DARTS's; on
    SmolLM2-135M's width (576, rank 16, 1184 positions) both are 700,416 (rank 608)."""
    from darts_bench.controls import MATCH_TOLERANCE, param_matched_rank

    assert param_matched_rank(576, 16, 1184) == 608
    for d, r, L, overflow in ((576, 16, 1184, "clamp"), (128, 16, 301, "clamp"), (128, 16, 301, "bucket"),
                              (64, 8, 3, "zero"), (16, 1, 2, "clamp"), (4096, 16, 2048, "clamp")):
        darts = build_head("darts", d, rank=r, max_len=L, overflow=overflow).num_parameters()
        rank = param_matched_rank(d, r, L, overflow)
        matched = build_head("surgery", d, rank=rank, max_len=L, overflow=overflow).num_parameters()
        assert matched == 2 * d * rank
        assert abs(matched - darts) <= MATCH_TOLERANCE * darts, (d, r, L, overflow, matched, darts)
        assert abs(matched - darts) <= d  # the closest rank: within half a rank step (2 d) of DARTS
    assert build_head("darts", 576, rank=16, max_len=1184).num_parameters() == 700_416
    assert build_head("surgery", 576, rank=608, max_len=1184).num_parameters() == 700_416
