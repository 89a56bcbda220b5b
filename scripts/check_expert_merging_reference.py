"""Compare darts_bench/merge/expert_merging.py with the authors' code on a tiny Llama pool.

Usage: ``python scripts/check_expert_merging_reference.py PATH`` where PATH is a checkout of
github.com/Littleor/ExpertMerging (read at 5282936; it has no licence file, so none of it is copied
here: this script imports it from PATH). Needs ``accelerate`` (imported by the authors' module).

What is compared, on three random sequences each aligned to its own expert (two experts):
  * merged tensors: the authors' ``BaseParametricTaskVectorModel._get_merged_params`` (coefficients
    sigmoid(w), their exclusion regexes) against :meth:`SigmoidLayerWiseMerge.params` at the same w;
  * the loss of each sequence (batch 1, as their ``train_step``): their ``compute_ce_loss`` +
    ``compute_hidden_states_loss`` (hidden layer L // 2) + ``compute_regularization_loss`` against
    :func:`alignment_loss` + :func:`regulariser`, at a w away from the init (so the regulariser counts).
Prints the largest differences and exits 1 when one is above 1e-5 (relative for the losses).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path


def main(path: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from darts_bench.merge.expert_merging import EXCLUDE, SigmoidLayerWiseMerge, alignment_loss, regulariser

    sys.path[:0] = [str(Path(path) / "global_utils")]
    import expert_merging_base as ref  # noqa: E402 (the authors' module, from PATH)

    kw = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    experts = []
    for i in range(2):
        m = LlamaForCausalLM(LlamaConfig(**kw)).eval()
        m.load_state_dict(base.state_dict())
        m.config._name_or_path = f"expert-{i}"
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.3 * torch.randn_like(p))
        experts.append(m)
    theirs = ref.BaseParametricTaskVectorModel(base, experts, list(EXCLUDE), device=torch.device("cpu"),
                                               weight_coeffs_init_value=0.1)
    ours = SigmoidLayerWiseMerge(base, [dict(e.named_parameters()) for e in experts])
    keys = [n.replace(".", "_") for n in ours.names]
    assert sorted(keys) == sorted(theirs.weight_coeffs.keys()), "the merged tensors differ"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k in keys:
            theirs.weight_coeffs[k].add_(0.5 * torch.randn(theirs.weight_coeffs[k].shape, generator=g))
    w = torch.stack([theirs.weight_coeffs[k][:, 0].detach() for k in keys], dim=1)  # [K, L]
    a = theirs.get_final_merged_params()
    b = ours.params(w)
    d_params = max(float((a[n] - b[n]).detach().abs().max()) for n in ours.names)

    class Trainer(ref.BaseExpertMergingTrainer):  # the loss methods only: no Accelerator
        def _prepare_inputs(self, *a, **k):
            raise NotImplementedError

        def train_step(self, batch):
            raise NotImplementedError

    tr = object.__new__(Trainer)
    tr.temperature, tr.loss_device, tr.student_device = 2.0, torch.device("cpu"), torch.device("cpu")
    tr.hidden_states_layers, tr.hidden_states_weight = [1], 0.5
    tr.sparsity_reg_weight, tr.student_model, tr.teacher_models = 5.0, theirs, experts
    worst = 0.0
    for i, (seq, k) in enumerate([([1, 5, 9, 3, 7], 0), ([2, 4, 6], 1), ([8, 8, 1, 2], 0)]):
        ids = torch.tensor([seq])
        with torch.no_grad():
            te = experts[k](input_ids=ids, output_hidden_states=True)
            so = theirs(input_ids=ids, output_hidden_states=True)
            hs, _ = tr.compute_hidden_states_loss(te.hidden_states, so.hidden_states)
            want = float(tr.compute_ce_loss(te.logits, so.logits) + tr.compute_regularization_loss() + hs)
            mo = ours.forward(w, ids, torch.ones_like(ids))
            got = float(alignment_loss(mo.logits, te.logits, mo.hidden_states[1], te.hidden_states[1],
                                       torch.ones_like(ids), 2.0, 0.5)[0] + regulariser(w, 0.1, 5.0))
        rel = abs(got - want) / abs(want)
        worst = max(worst, rel)
        print(f"sequence {i} (expert {k}): authors {want:.8f}  ours {got:.8f}  relative difference {rel:.2e}")
    print(f"merged tensors: largest absolute difference {d_params:.2e} over {len(ours.names)} tensors")
    return 0 if d_params <= 1e-5 and worst <= 1e-5 else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        raise SystemExit(2)
    raise SystemExit(main(sys.argv[1]))
