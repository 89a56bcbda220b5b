"""RegMean: merge each linear layer in closed form from its inputs' Gram matrices.

Source: Jin et al., ICLR 2023, "Dataless Knowledge Fusion by Merging Weights of Language Models".
For a linear layer y = x W^T with weights W_k in expert k and inputs X_k (rows: the layer's input
vectors on expert k's own data), the merge minimising sum_k ||X_k W^T - X_k W_k^T||^2 is the
paper's closed form of merging linear regression models::

    W*^T = (sum_k G_k)^-1 sum_k G_k W_k^T,        G_k = X_k^T X_k   [d_in, d_in]

with the paper's regularisation: every G_k's off-diagonal entries scaled by ``alpha``
(G~_k = alpha G_k + (1 - alpha) diag(G_k); alpha = 1 is the plain closed form, alpha = 0 a
per-input-feature weighted average). Every other parameter (embeddings, norms, biases, and the
output layer when it is tied to the input embeddings) is the experts' simple average, as the paper
does for non-linear weights. G_k is the plain sum over the real (non-pad) token positions of
expert k's data (not a mean), in fp64; the solve is fp64 (``torch.linalg.solve``).

Data: for expert k, the calibration prompts (inputs only) of its own task(s), ``spec.calibration_split``
(:mod:`darts_bench.merge.data`); an expert whose task is not in the run has no data and the merge
fails with an error naming it.

Why not FusionBench (``fusion-bench`` 0.2.33): ``RegMeanAlgorithm.run`` takes a ``BaseModelPool``
and leaves ``get_regmean_weights`` (how a batch is fed) to subclasses, which exist for CLIP vision
models and GPT-2 sequence classifiers (``RegMeanAlgorithmForGPT2`` builds Conv1D-specific hooks and
classification heads) only. Its module-level ``merging_with_regmean_weights`` is the same closed form
written here in a few lines, but importing it installs lightning, hydra-core, omegaconf,
tensorboard, h5py and torchmetrics, and it merges every ``nn.Linear`` including a tied ``lm_head``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

log = logging.getLogger("darts_bench")
#: the file beside the merged weights with the merge's data and layer counts
SUMMARY = "regmean.json"
PAPER = "Jin et al., ICLR 2023, Dataless Knowledge Fusion by Merging Weights of Language Models (RegMean)"


def regularised_gram(gram: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * G + (1 - alpha) * diag(G)``: off-diagonals scaled by ``alpha``. gram [d, d] -> [d, d]."""
    return alpha * gram + (1 - alpha) * torch.diag(torch.diagonal(gram))


def regmean_linear(grams: list[torch.Tensor], weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """RegMean's closed form for one linear layer: ``W* = (sum_k G~_k W_k^T)^T solved against sum_k G~_k``.

    Args:
        grams: K Gram matrices [d_in, d_in] (X_k^T X_k of the layer's inputs on expert k's data).
        weights: K weights [d_out, d_in] (torch's ``nn.Linear`` layout).
        alpha: off-diagonal scale in [0, 1] (:func:`regularised_gram`).
    Returns:
        W* [d_out, d_in] in fp64.
    Raises:
        ValueError: the summed Gram matrix is singular (e.g. alpha = 1 with fewer tokens than inputs)."""
    gs = [regularised_gram(g.double(), alpha) for g in grams]
    lhs = sum(gs)
    rhs = sum(g @ w.double().T for g, w in zip(gs, weights))  # [d_in, d_out]
    sol, info = torch.linalg.solve_ex(lhs, rhs)
    if int(info) != 0:
        raise ValueError(f"RegMean: the summed Gram matrix [{lhs.shape[0]}x{lhs.shape[0]}] is singular "
                         f"(alpha {alpha}); use alpha < 1 or more data")
    return sol.T


def linear_modules(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The ``nn.Linear`` modules RegMean merges: all of them but an output layer tied to the input
    embeddings (that tensor is the embedding, averaged)."""
    tied = None
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        tied = out_emb
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not tied}


@torch.no_grad()
def input_grams(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, int]:
    """``({module name: X^T X fp64 [d_in, d_in]}, tokens)``: each :func:`linear_modules` input summed over the
    real positions (``attention_mask`` 1) of ``batches`` ([B, T] ids and mask each).

    Modules called one after another on the same input tensor (a decoder layer's q / k / v projections,
    its MLP's gate and up projections) share one product: the Gram matrix of the last input is kept
    with the input itself (held, so its memory cannot be reused by another tensor meanwhile) and reused
    while the next module's input *is* that tensor, so a Llama layer computes 4 products instead of 7
    (the same values bit for bit)."""
    mods = linear_modules(model)
    grams: dict[str, torch.Tensor] = {}
    state: dict = {"last": None}

    def hook(name):
        def fn(_mod, inputs, _out):
            last = state["last"]
            if last is not None and last[0] is inputs[0]:
                g = last[1]
            else:
                x = inputs[0][state["mask"]].double()  # [n_real, d_in]
                g = x.T @ x
                state["last"] = (inputs[0], g)
            grams[name] = grams[name] + g if name in grams else g
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in mods.items()]
    tokens = 0
    try:
        for ids, mask in batches:
            state["mask"] = mask.bool()
            model(input_ids=ids, attention_mask=mask)
            state["last"] = None
            tokens += int(mask.sum())
    finally:
        state["last"] = None
        for h in handles:
            h.remove()
    return grams, tokens


def build_regmean(spec, base_dir: Path, experts: dict[str, Path], prompts: dict[str, tuple[str, list[str]]],
                  tokenizer, cfg, out: Path) -> dict:
    """Merge ``experts`` with RegMean, expert k's Gram matrices from its own tasks' prompts
    (``{task: (expert, prompts)}``); write the checkpoint into ``out``. Returns a summary (tokens per
    expert, layers merged in closed form / averaged).

    Raises:
        ValueError: an expert has no task (no data) among ``prompts``."""
    from darts_bench.merge.data import load_model, prompt_batches, save_merged

    names = list(experts)
    per_expert = {e: [p for _, (ex, ps) in sorted(prompts.items()) if ex == e for p in ps] for e in names}
    lacking = [e for e, ps in per_expert.items() if not ps]
    if lacking:
        raise ValueError(f"merge {spec.name!r} (regmean): expert(s) {lacking} have no task in this run, so no data "
                         f"for their Gram matrices (tasks with data: {sorted(prompts)}); run a suite with their "
                         "tasks or drop the merge")
    sum_g: dict[str, torch.Tensor] = {}
    sum_gw: dict[str, torch.Tensor] = {}
    avg: dict[str, torch.Tensor] = {}
    tokens = {}
    for e in names:
        model = load_model(experts[e], cfg.device)
        batches = [(i.to(cfg.device), a.to(cfg.device)) for i, a in
                   prompt_batches(tokenizer, per_expert[e], spec.batch_size, cfg.calibration.max_prompt_tokens)]
        grams, tokens[e] = input_grams(model, batches)
        mods = linear_modules(model)
        for n, g in grams.items():
            gt = regularised_gram(g, spec.alpha)
            w = mods[n].weight.detach().double()
            sum_g[n] = sum_g[n] + gt if n in sum_g else gt
            sum_gw[n] = sum_gw[n] + gt @ w.T if n in sum_gw else gt @ w.T
        linear_w = {f"{n}.weight" for n in mods}
        for n, p in model.named_parameters():
            if n not in linear_w:
                if n in avg and avg[n].shape != p.shape:
                    raise ValueError(f"merge {spec.name!r} (regmean): {n} is {tuple(p.shape)} in expert {e} but "
                                     f"{tuple(avg[n].shape)} in {names[0]}; RegMean needs experts of one shape "
                                     "(pool.vocab_alignment=base with appended tokens is not supported)")
                avg[n] = avg[n] + p.detach().double() if n in avg else p.detach().double()
        del model, grams
    model = load_model(base_dir, cfg.device)
    mods = linear_modules(model)
    with torch.no_grad():
        for n, m in mods.items():
            sol, info = torch.linalg.solve_ex(sum_g[n], sum_gw[n])
            if int(info) != 0:
                raise ValueError(f"merge {spec.name!r} (regmean): the summed Gram matrix of {n} is singular "
                                 f"(alpha {spec.alpha}); use alpha < 1 or more data")
            m.weight.copy_(sol.T.to(m.weight.dtype))
        for n, p in model.named_parameters():
            if n in avg:
                p.copy_((avg[n] / len(names)).to(p.dtype))
    summary = {"method": "regmean", "paper": PAPER, "alpha": spec.alpha, "batch_size": spec.batch_size,
               "experts": names, "calibration_split": spec.calibration_split,
               "tokens": tokens, "prompts": {e: len(ps) for e, ps in per_expert.items()},
               "closed_form_layers": len(mods), "averaged_tensors": len(avg)}
    save_merged(model, base_dir, out, spec.dtype)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1))
    log.info("regmean %s: %d linear layers in closed form, %d tensors averaged; tokens %s", spec.name, len(mods),
             len(avg), tokens)
    return summary
