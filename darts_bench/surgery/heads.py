"""Correction heads applied to the merged model's final hidden state (input of ``lm_head``).

Surgery (Yang et al., ICML 2024, Sec. 4.2, Eq. 5-6): ``h' = h - W_up ReLU(W_down h)`` with
``W_down: d -> r``, ``W_up: r -> d``, ``W_up`` zero-initialised so the head starts as the identity.

DARTS (Sharma et al., EMNLP 2026, arXiv 2608.28547, abstract: per-position bias): ``h' = h - W_up ReLU(W_down h) + b[pos]`` with ``b`` a
zero-initialised ``[max_len, d]`` table indexed by the token's absolute position (counted from the
attention mask, so left padding does not shift it). Positions ``>= max_len`` follow ``overflow``:
``clamp`` (use row ``max_len - 1``), ``zero`` (no bias), ``bucket`` (log-spaced buckets above
``max_len // 2``, as T5's relative buckets).

Methods (per (merge, task)): ``surgery`` (no bias, L1), ``darts`` (bias, entropy-weighted L1),
and the two ablations ``darts_ew_only`` (no bias, entropy-weighted L1) and ``darts_pos_only``
(bias, plain L1).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

# method -> (position bias?, entropy-weighted loss?)
METHODS: dict[str, tuple[bool, bool]] = {
    "surgery": (False, False),
    "darts": (True, True),
    "darts_ew_only": (False, True),
    "darts_pos_only": (True, False),
}


@dataclass(frozen=True)
class HeadConfig:
    method: str
    d_model: int
    rank: int = 16
    max_len: int = 512
    overflow: str = "clamp"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown correction method {self.method!r}; known: {sorted(METHODS)}")
        if self.overflow not in ("clamp", "zero", "bucket"):
            raise ValueError(f"unknown overflow policy {self.overflow!r} (clamp | zero | bucket)")
        if self.position_bias and (self.max_len is None or self.max_len < 1):
            raise ValueError(f"{self.method}: a position-bias head needs max_len >= 1, got {self.max_len!r} "
                             "(surgery.max_len unset: resolve it with darts_bench.positions.resolve_max_len, "
                             "as Pipeline.surgery_config does)")

    @property
    def position_bias(self) -> bool:
        return METHODS[self.method][0]

    @property
    def entropy_weighted(self) -> bool:
        return METHODS[self.method][1]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Absolute token positions from a (left- or right-padded) attention mask.

    Args:
        attention_mask: ``[batch, seq]`` of 0/1.
    Returns:
        ``[batch, seq]`` int64: 0 at each row's first real token, counting real tokens only;
        padding positions get 0.
    """
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0) * attention_mask.long()


class CorrectionHead(nn.Module):
    """Surgery / DARTS head. ``forward(h, positions)`` maps ``[..., d]`` float hidden states and
    ``[...]`` int64 absolute positions to corrected ``[..., d]`` hidden states (same dtype)."""

    N_BUCKETS = 16  # overflow=bucket: log2-spaced rows after the max_len position rows

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        self.down = nn.Linear(cfg.d_model, cfg.rank, bias=False)  # W_down: [r, d]
        self.up = nn.Linear(cfg.rank, cfg.d_model, bias=False)  # W_up: [d, r], zero-init
        nn.init.zeros_(self.up.weight)
        if cfg.position_bias:
            n_rows = cfg.max_len + (self.N_BUCKETS if cfg.overflow == "bucket" else 0)
            self.pos_bias = nn.Parameter(torch.zeros(n_rows, cfg.d_model))  # b: [max_len(+buckets), d]
        else:
            self.register_parameter("pos_bias", None)

    def bias_index(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row of the bias table for each position and a {0,1} float mask (0 = no bias)."""
        L = self.cfg.max_len
        over = positions >= L
        keep = torch.ones_like(positions, dtype=torch.float32)
        if self.cfg.overflow == "clamp":
            idx = positions.clamp(max=L - 1)
        elif self.cfg.overflow == "zero":
            idx = positions.clamp(max=L - 1)
            keep = (~over).float()
        else:  # bucket: log-spaced buckets for positions >= L, rows L .. L+15
            rel = (positions - L).clamp_min(0).float() + 1.0
            b = torch.floor(torch.log2(rel)).long().clamp(max=self.N_BUCKETS - 1)
            idx = torch.where(over, L + b, positions)
        return idx, keep

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        dt = h.dtype
        x = h.to(self.down.weight.dtype)
        out = x - self.up(torch.relu(self.down(x)))  # Eq. (5): h - W_up ReLU(W_down h)
        if self.pos_bias is not None:
            if positions is None:
                raise ValueError("a DARTS head with a position bias needs positions")
            idx, keep = self.bias_index(positions)
            # F.embedding, not self.pos_bias[idx]: the same rows forward, but the backward of indexing
            # (index_put_ with accumulate) adds a batch's repeated positions with parallel atomic float
            # adds once the batch has >= 32,768 elements and torch has > 1 thread, so the gradient's
            # rounding depended on a thread race (DARTS heads of one config differed run to run at
            # torch_threads 2). embedding's backward adds in token order: bitwise the 1-thread result.
            bias = nn.functional.embedding(idx, self.pos_bias)
            if self.cfg.overflow == "zero":
                bias = bias * keep.unsqueeze(-1).to(bias.dtype)
            out = out + bias
        return out.to(dt)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_head(method: str, d_model: int, rank: int = 16, max_len: int = 512, overflow: str = "clamp",
               seed: int = 0) -> CorrectionHead:
    """A fresh head; ``W_down`` is Kaiming-uniform from a generator seeded by ``seed`` (never the
    global RNG), ``W_up`` and the bias table are zero, so the head is exactly the identity."""
    cfg = HeadConfig(method=method, d_model=d_model, rank=rank, max_len=max_len, overflow=overflow)
    head = CorrectionHead(cfg)
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(d_model)
    with torch.no_grad():
        head.down.weight.copy_(torch.rand(head.down.weight.shape, generator=g) * 2 * bound - bound)
    return head


def save_head(head: CorrectionHead, out_dir: Path, extra: dict | None = None) -> None:
    """Write ``head.safetensors`` + ``head_config.json`` into ``out_dir`` (caller makes it atomic)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()},
              str(out_dir / "head.safetensors"))
    (out_dir / "head_config.json").write_text(json.dumps({**asdict(head.cfg), **(extra or {})}, indent=1))


def load_head(head_dir: Path | str) -> CorrectionHead:
    """Load a head saved by :func:`save_head`.

    Raises:
        FileNotFoundError: missing files; ValueError: config/tensor mismatch.
    """
    head_dir = Path(head_dir)
    cfg_path, w_path = head_dir / "head_config.json", head_dir / "head.safetensors"
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"head file missing: {p}")
    raw = json.loads(cfg_path.read_text())
    cfg = HeadConfig(**{k: raw[k] for k in ("method", "d_model", "rank", "max_len", "overflow")})
    head = CorrectionHead(cfg)
    state = load_file(str(w_path))
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"head weights in {w_path} do not match {cfg_path}: {e}") from None
    return head.eval()
