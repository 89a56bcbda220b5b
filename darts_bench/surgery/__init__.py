"""Representation surgery (Yang et al., ICML 2024) and DARTS (Sharma et al., EMNLP 2026) heads,
losses, training on cached features, corrected generation and diagnostics."""

from darts_bench.surgery.heads import METHODS, CorrectionHead, build_head, load_head, save_head
from darts_bench.surgery.losses import entropy_weights, l1_loss, weighted_l1_loss

__all__ = [
    "METHODS",
    "CorrectionHead",
    "build_head",
    "load_head",
    "save_head",
    "entropy_weights",
    "l1_loss",
    "weighted_l1_loss",
]
