"""Routers for the task-agnostic ``@routed`` rows: which task's head a prompt gets, from the merged
model's own hidden state of the prompt.

Every corrected row applies the head of the benchmark's own task (an oracle label a deployed merged
model does not have). A ``<merge>+<method>@routed`` row instead picks, per prompt, the head of the task
a router predicts from the prompt's feature: the merged model's final hidden state (after the last
norm, the input of ``lm_head``) mean-pooled over the prompt's tokens, ``[d_model]`` float32.

Routers (``surgery.routing.router``), fitted with scikit-learn on the calibration prompts the heads
train on (the train split of each task's calibration set; the held-out split is never seen):

* ``centroid`` (default): nearest task centroid in Euclidean distance, the nearest-centroid classifier
  (Tibshirani et al., PNAS 2002, "Diagnosis of multiple cancer types by shrunken centroids of gene
  expression", without shrinkage; ``sklearn.neighbors.NearestCentroid``);
* ``probe``: multinomial logistic regression on standardised features (a linear probe, Alain & Bengio
  2016, "Understanding intermediate layers using linear classifier probes";
  ``sklearn.preprocessing.StandardScaler`` + ``sklearn.linear_model.LogisticRegression``, lbfgs, L2
  with ``surgery.routing.C``).

The fitted parameters are stored as float64 arrays (``router.json``) and applied with the same
formulas in numpy (:meth:`Router.predict`; equal to scikit-learn's ``predict`` on the fitted estimator,
tested), so a router loads without pickles. Routing accuracy per task: the fraction of a task's
prompts routed to that task, on its held-out calibration prompts (train stage) and on the evaluated
benchmark prompts (evaluate stage).

:func:`chunk_plan` is the one rule both evaluation paths use to run a routed row's prompts, so its
outputs equal the single-head rows' token for token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

#: what ``router.json`` holds (in the router's cache key)
ROUTER_VERSION = 1


def prompt_features(h: np.ndarray, positions: np.ndarray, seq_index: np.ndarray, prompt_len: Sequence[int],
                    n_sequences: int) -> np.ndarray:
    """Mean-pooled prompt features of a calibration set from its stored per-token features.

    Args:
        h: ``[N, d_model]`` the merged model's final hidden states of every stored token.
        positions, seq_index: ``[N]`` int, each token's absolute position and sequence.
        prompt_len: per sequence, its prompt's token count (``sequences.json``'s ``prompt_len``).
        n_sequences: the number of sequences.
    Returns:
        ``[n_sequences, d_model]`` float64: per sequence the mean of ``h`` over positions
        ``0 .. prompt_len - 1`` (the prompt; under the causal mask they do not depend on the
        continuation).
    Raises:
        ValueError: a sequence with no prompt token among the stored tokens.
    """
    plen = np.asarray(prompt_len)[seq_index]
    keep = positions < plen
    sums = np.zeros((n_sequences, h.shape[1]), dtype=np.float64)
    np.add.at(sums, seq_index[keep], h[keep].astype(np.float64))
    counts = np.bincount(seq_index[keep], minlength=n_sequences)
    if (counts == 0).any():
        raise ValueError(f"prompt_features: sequences {np.nonzero(counts == 0)[0].tolist()[:5]} have no prompt token")
    return sums / counts[:, None]


@dataclass
class Router:
    """A fitted router: ``classes`` (task names, the order of the class indices), ``kind``
    (``centroid`` | ``probe``) and its parameters (float64): ``centroids`` ``[k, d]``, or ``mean`` /
    ``scale`` ``[d]`` (the standardisation), ``coef`` ``[k, d]`` and ``intercept`` ``[k]``."""

    kind: str
    classes: list[str]
    params: dict[str, np.ndarray]

    def decision(self, X: np.ndarray) -> np.ndarray:
        """``[n, k]`` scores, larger = more likely: minus the squared distance to each centroid, or
        the probe's logits."""
        X = np.asarray(X, dtype=np.float64)
        if self.kind == "centroid":
            c = self.params["centroids"]
            return -((X[:, None, :] - c[None, :, :]) ** 2).sum(-1)
        Z = (X - self.params["mean"]) / self.params["scale"]
        return Z @ self.params["coef"].T + self.params["intercept"]

    def predict(self, X: np.ndarray) -> list[str]:
        """The routed task of each row of ``X`` (``[n, d]``): the class with the largest
        :meth:`decision` (first class on a tie, as scikit-learn's argmax)."""
        if len(X) == 0:
            return []
        return [self.classes[i] for i in np.argmax(self.decision(X), axis=1)]

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"version": ROUTER_VERSION, "kind": self.kind, "classes": self.classes,
                                          "params": {k: v.tolist() for k, v in self.params.items()}}))

    @classmethod
    def load(cls, path: Path) -> "Router":
        """Raises FileNotFoundError / ValueError: a missing file or another ``router.json`` version."""
        d = json.loads(Path(path).read_text())
        if d.get("version") != ROUTER_VERSION:
            raise ValueError(f"{path}: router.json version {d.get('version')}, expected {ROUTER_VERSION}")
        return cls(d["kind"], list(d["classes"]), {k: np.asarray(v, dtype=np.float64) for k, v in d["params"].items()})


def fit_router(X_by_task: dict[str, np.ndarray], kind: str = "centroid", C: float = 1.0):
    """Fit a router on ``{task: [n_t, d] features}`` (classes in the dict's order).

    Returns:
        ``(Router, estimator)``: the stored router and the fitted scikit-learn estimator (a
        ``Pipeline`` for the probe) it was read from.
    Raises:
        ValueError: fewer than two tasks, a task without features, or an unknown ``kind``.
    """
    classes = list(X_by_task)
    if len(classes) < 2:
        raise ValueError(f"a router needs at least two tasks with calibration features, got {classes}")
    for t, X in X_by_task.items():
        if len(X) == 0:
            raise ValueError(f"router: task {t!r} has no training prompts")
    X = np.concatenate([np.asarray(X_by_task[t], dtype=np.float64) for t in classes])
    y = np.concatenate([np.full(len(X_by_task[t]), i) for i, t in enumerate(classes)])
    if kind == "centroid":
        from sklearn.neighbors import NearestCentroid

        est = NearestCentroid().fit(X, y)
        params = {"centroids": np.asarray(est.centroids_, dtype=np.float64)[np.argsort(est.classes_)]}
    elif kind == "probe":
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        est = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000)).fit(X, y)
        sc, lr = est[0], est[1]
        coef, icpt = np.asarray(lr.coef_, dtype=np.float64), np.asarray(lr.intercept_, dtype=np.float64)
        if coef.shape[0] == 1:  # two classes: sklearn keeps one row (the logit of class 1)
            coef, icpt = np.vstack([np.zeros_like(coef[0]), coef[0]]), np.array([0.0, icpt[0]])
        params = {"mean": np.asarray(sc.mean_, dtype=np.float64), "scale": np.asarray(sc.scale_, dtype=np.float64),
                  "coef": coef, "intercept": icpt}
    else:
        raise ValueError(f"unknown router {kind!r}; known: centroid, probe")
    return Router(kind, classes, params), est


def routing_accuracy(routed: Sequence[str], task: str) -> float | None:
    """Fraction of ``routed`` (the routed task of each of ``task``'s prompts) equal to ``task``; None
    for no prompts."""
    return None if not len(routed) else float(np.mean([r == task for r in routed]))


def chunk_plan(choices: Sequence[str], batch_size: int, whole: bool = False) -> dict[str, list[int]]:
    """Which prompts a routed row runs under each head: ``{task: prompt indices}``, tasks in order of
    first choice.

    A single-head row runs its prompts in chunks of ``batch_size`` (``HFTextModel``; the one-pass
    path copies it), and a prompt's output depends on its chunk (left padding). So head ``t`` runs
    every chunk that holds a prompt routed to ``t``, whole and in order: each such prompt then gets
    exactly the output the single-head row with head ``t`` gives it. ``whole=True`` (sampled
    generation, whose per-chunk seeds depend on the chunk's offset in the call): every prompt, for
    each chosen head.
    """
    n = len(choices)
    plan: dict[str, list[int]] = {}
    for t in dict.fromkeys(choices):
        if whole:
            plan[t] = list(range(n))
            continue
        idx: list[int] = []
        for s in range(0, n, batch_size):
            if t in choices[s:s + batch_size]:
                idx += range(s, min(s + batch_size, n))
        plan[t] = idx
    return plan


def pick(choices: Sequence[str], plan: dict[str, list[int]], outputs: dict[str, list]) -> list:
    """Per prompt ``j`` the output of its routed head: ``outputs[t]`` holds head ``t``'s outputs of the
    prompts ``plan[t]`` (in that order)."""
    where = {t: {j: k for k, j in enumerate(idx)} for t, idx in plan.items()}
    return [outputs[t][where[t][j]] for j, t in enumerate(choices)]


def sequence_routed_head(heads: dict, seq_task: dict[int, str]):
    """A head chosen per sequence, for the diagnostics of a ``@routed`` row on calibration or
    reference tokens (:class:`darts_bench.surgery.diagnostics.Diagnostics` calls it with each token's
    sequence index).

    Args:
        heads: task -> :class:`~darts_bench.surgery.heads.CorrectionHead`.
        seq_task: sequence index -> the task its prompt is routed to.
    Returns:
        an ``nn.Module`` with ``per_sequence = True`` whose ``forward(h [n, d], positions [n],
        seq_index [n])`` applies to each token the head of its sequence's routed task.
    Raises:
        KeyError (at call time): a token of a sequence without a routing decision.
    """
    import torch
    from torch import nn

    classes = list(heads)

    class SequenceRoutedHead(nn.Module):
        per_sequence = True

        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([heads[t] for t in classes])
            self.seq_task = {int(k): classes.index(v) for k, v in seq_task.items()}

        def which(self, seq_index):
            """``[n]`` int64: the index into ``self.heads`` of each token's routed head (``seq_index``
            ``[n]`` int64)."""
            return torch.tensor([self.seq_task[int(i)] for i in seq_index.tolist()], device=seq_index.device)

        def forward(self, h, positions, seq_index):
            which = self.which(seq_index).to(h.device)
            out = h.clone()
            for k in which.unique().tolist():
                idx = (which == k).nonzero()[:, 0]
                out[idx] = self.heads[k](h[idx], positions[idx])
            return out

    return SequenceRoutedHead()


__all__ = ["ROUTER_VERSION", "Router", "sequence_routed_head", "chunk_plan", "fit_router", "pick", "prompt_features", "routing_accuracy"]
