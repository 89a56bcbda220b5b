"""AdaMerging: layer-wise merge coefficients learned by entropy minimisation on unlabelled inputs.

Source: Yang et al., ICLR 2024, "AdaMerging: Adaptive Model Merging for Multi-Task Learning"
(layer-wise AdaMerging). The merged weights are task arithmetic with one coefficient per expert k
and parameter tensor l::

    theta[l] = theta_base[l] + sum_k lambda[k, l] * tau_k[l],    tau_k = theta_expert_k - theta_base

and lambda (shape [K experts, L parameter tensors], initialised at task arithmetic's 0.3 as the
paper does) minimises the paper's objective, the Shannon entropy of the merged model's predictions
on unlabelled test inputs, with Adam. For a decoder the predictions are the next-token
distributions: the loss is the mean entropy (nats) over every real (non-pad) position of the
calibration *prompts* (each position's distribution over the next token; the last one is the
distribution of the first generated token). The data are the run's calibration prompts of
``spec.calibration_split`` for every task with an expert (:mod:`darts_bench.merge.data`): benchmark
inputs for the transductive split (the paper's test-time setting), training prompts for the
inductive one; no continuation, reference answer or label is read. Step s uses batch ``order[s % n]``
of a permutation of the prompt batches redrawn from the run seed each pass. The merged forward is
``torch.func.functional_call`` over the frozen base with the merged tensors, so gradients reach
lambda only. Each parameter tensor of ``model.named_parameters()`` is one group l (tied input and
output embeddings are one tensor); buffers (rotary tables) are the base's.

Why not FusionBench (``fusion-bench`` 0.2.33, the maintained implementation): its decoder version
(``fusion_bench.method.adamerging.llama_adamerging.LayerWiseAdaMergingForLlamaSFT``) minimises the
cross-entropy of labelled SFT data, not the paper's entropy ("Unlike the original AdaMerging
algorithm that uses test-time adaptation training to optimize the entropy loss. This algorithm
optimize the cross entropy loss", its docstring), and runs through Lightning Fabric and a hydra /
omegaconf-configured ``CausalLMPool``; its entropy versions are for CLIP, GPT-2 and Flan-T5
classifiers. Installing it would add lightning, hydra-core, omegaconf, tensorboard, h5py and
torchmetrics (``pip install --dry-run``: 14 packages) for about a hundred lines written here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import torch
from torch.func import functional_call

log = logging.getLogger("darts_bench")
#: the file beside the merged weights with the learned coefficients
COEFFICIENTS = "adamerging.json"
PAPER = "Yang et al., ICLR 2024, AdaMerging: Adaptive Model Merging for Multi-Task Learning (layer-wise)"


def mean_entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean Shannon entropy (nats, fp32) of ``softmax(logits)`` over the positions where ``mask`` is 1.

    Args: logits [B, T, V]; mask [B, T] (1 = real token). Returns a scalar."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    h = -(logp.exp() * logp).sum(-1)  # [B, T]
    m = mask.to(h.dtype)
    return (h * m).sum() / m.sum()


class LayerWiseMerge:
    """theta(lambda) = theta_base + sum_k lambda[k, l] tau_k[l] over ``model``'s parameter tensors.

    Args:
        model: the base model (its parameters are theta_base; frozen; it runs the merged forward).
        experts: K state dicts (name -> tensor) of the experts, covering ``model.named_parameters()``.
    Raises:
        ValueError: an expert lacks a parameter of the base or has another shape."""

    def __init__(self, model: torch.nn.Module, experts: list[dict[str, torch.Tensor]]):
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]  # L groups (tied tensors once)
        base = dict(model.named_parameters())
        self.base = {n: base[n].detach() for n in self.names}
        self.tau: list[dict[str, torch.Tensor]] = []
        for k, sd in enumerate(experts):
            missing = [n for n in self.names if n not in sd or sd[n].shape != self.base[n].shape]
            if missing:
                raise ValueError(f"expert {k} lacks (or reshapes) parameter(s) {missing[:3]} of the base; AdaMerging "
                                 "needs experts of the base's shapes (pool.vocab_alignment=base with appended tokens "
                                 "is not supported)")
            self.tau.append({n: (sd[n].to(self.base[n]) - self.base[n]) for n in self.names})

    @property
    def shape(self) -> tuple[int, int]:
        """(K experts, L parameter tensors)."""
        return len(self.tau), len(self.names)

    def params(self, lam: torch.Tensor) -> dict[str, torch.Tensor]:
        """The merged tensors for ``lam`` [K, L] (differentiable in ``lam``)."""
        return {n: self.base[n] + sum(lam[k, l] * self.tau[k][n] for k in range(len(self.tau)))
                for l, n in enumerate(self.names)}

    def logits(self, lam: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Merged model's logits [B, T, V] for ``input_ids`` [B, T] (``functional_call``); ``params``:
        ``self.params(lam)`` already computed (the same tensors, so the same logits bit for bit)."""
        out = functional_call(self.model, self.params(lam) if params is None else params, args=(),
                              kwargs={"input_ids": input_ids, "attention_mask": attention_mask})
        return out.logits if hasattr(out, "logits") else out

    def corpus_entropy(self, lam: torch.Tensor, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The mean entropy (nats) of the merge at ``lam`` [K, L] over every real position of ``batches``:
        each batch's :func:`mean_entropy` weighted by its real-token count. No gradients; the merged
        tensors are computed once for all batches (as many forwards, one recombination: on SmolLM2-135M
        a recombination costs about as much as a batch-of-4 forward), so each batch's value is the
        one :meth:`loss` gives bit for bit.

        Raises:
            ValueError: no batches, or no real token in them."""
        n = sum(int(b[1].sum()) for b in batches)
        if n == 0:
            raise ValueError("AdaMerging's corpus entropy needs at least one real (non-pad) token")
        with torch.no_grad():
            params = self.params(lam)
            return sum(mean_entropy(self.logits(lam, ids, mask, params), mask).item() * int(mask.sum())
                       for ids, mask in batches) / n

    def loss(self, lam: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The AdaMerging objective on one batch: :func:`mean_entropy` of the merged predictions."""
        ids, mask = batch
        return mean_entropy(self.logits(lam, ids, mask), mask)


def learn_coefficients(merge: LayerWiseMerge, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
                       lr: float, init: float, seed: int,
                       on_step: Callable[[int, float], None] | None = None) -> tuple[torch.Tensor, list[float]]:
    """Adam on lambda [K, L] from ``init`` for ``steps`` steps, one batch per step (order: a
    permutation of ``batches`` from ``seed``, redrawn each pass). Returns ``(lambda fp32 [K, L],
    entropy per step (nats, before that step's update))``.

    Raises:
        ValueError: no batches, or the entropy became non-finite (the step is named)."""
    if not batches:
        raise ValueError("AdaMerging needs at least one batch of prompts")
    lam = torch.full(merge.shape, float(init), dtype=torch.float32, requires_grad=True)
    opt = torch.optim.Adam([lam], lr=lr)
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    history = []
    for step in range(steps):
        if not order:
            order = torch.randperm(len(batches), generator=g).tolist()
        loss = merge.loss(lam, batches[order.pop(0)])
        if not torch.isfinite(loss):
            raise ValueError(f"AdaMerging: entropy is {loss.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
        if on_step is not None:
            on_step(step, history[-1])
    return lam.detach(), history


def build_adamerging(spec, base_dir: Path, experts: dict[str, Path], prompts: dict[str, tuple[str, list[str]]],
                     tokenizer, cfg, out: Path) -> dict:
    """Learn the coefficients of merge ``spec`` on the prompts of every task (``{task: (expert,
    prompts)}``, all tasks' prompts pooled and shuffled into batches of ``spec.batch_size``), write
    the merged checkpoint into ``out`` (:func:`darts_bench.merge.data.save_merged`) and
    ``out/adamerging.json`` (lambda per expert per parameter tensor, the entropy before and after,
    per step, and the data). Returns that json's dict."""
    from darts_bench.merge.data import load_model, prompt_batches, save_merged

    names = list(experts)
    model = load_model(base_dir, cfg.device)
    sds = []
    for e in names:
        m = load_model(experts[e], "cpu")
        sds.append({n: p.detach().to(cfg.device) for n, p in m.named_parameters()})
        del m
    merge = LayerWiseMerge(model, sds)
    del sds
    all_prompts = [p for _, (_, ps) in sorted(prompts.items()) for p in ps]
    batches = [(i.to(cfg.device), a.to(cfg.device)) for i, a in
               prompt_batches(tokenizer, all_prompts, spec.batch_size, cfg.calibration.max_prompt_tokens)]
    every = max(1, spec.steps // 10)
    lam, history = learn_coefficients(
        merge, batches, spec.steps, spec.lr, spec.init, cfg.seed,
        on_step=lambda s, h: (s % every == 0 or s == spec.steps - 1)
        and log.info("adamerging %s: step %d/%d entropy %.4f nats", spec.name, s + 1, spec.steps, h))
    final = merge.corpus_entropy(lam, batches)
    initial = merge.corpus_entropy(torch.full(merge.shape, float(spec.init)), batches)
    with torch.no_grad():
        merged = merge.params(lam)
        for n, p in model.named_parameters():
            p.copy_(merged[n])
    record = {
        "method": "adamerging", "paper": PAPER,
        "objective": "mean next-token entropy (nats) of the merged model over the calibration prompts' positions",
        "init": spec.init, "steps": spec.steps, "lr": spec.lr, "batch_size": spec.batch_size, "seed": cfg.seed,
        "experts": names,
        "data": {"calibration_split": spec.calibration_split,
                 "prompts": {t: {"expert": e, "n": len(p)} for t, (e, p) in sorted(prompts.items())},
                 "tokens": int(sum(int(b[1].sum()) for b in batches)), "inputs_only": True},
        "entropy": {"initial": initial, "final": final, "per_step": history},
        # lambda[k, l]: expert -> {parameter tensor: coefficient}
        "coefficients": {e: {n: float(lam[k, l]) for l, n in enumerate(merge.names)} for k, e in enumerate(names)},
        "mean_coefficient": {e: float(lam[k].mean()) for k, e in enumerate(names)},
    }
    save_merged(model, base_dir, out, spec.dtype)
    (out / COEFFICIENTS).write_text(json.dumps(record, indent=1))
    log.info("adamerging %s: entropy %.4f -> %.4f nats over %d prompt tokens; mean lambda %s", spec.name, initial,
             final, record["data"]["tokens"], {e: round(v, 3) for e, v in record["mean_coefficient"].items()})
    return record
