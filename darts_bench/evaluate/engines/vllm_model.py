"""The correction head inside vLLM's model (imported by vLLM's worker process, needs ``vllm``).

:class:`DartsLlamaForCausalLM` is vLLM's ``LlamaForCausalLM`` whose ``forward`` applies a
:class:`~darts_bench.surgery.heads.CorrectionHead` to the final hidden states (after the last
norm, the input of ``lm_head``) with vLLM's per-token ``positions``: each token's absolute
position in its own request, also under chunked prefill and prefix caching, i.e. what
``positions_from_mask`` gives on the HF side. Logits, sampling and ``prompt_logprobs`` then see
the corrected states.

The head directory comes from ``hf_overrides={"architectures": ["DartsLlamaForCausalLM"],
"darts_head_dir": DIR}`` (empty: no head, the plain model), and can be swapped in a running
engine by :class:`DartsWorkerExtension` (``LLM.collective_rpc("darts_set_head", args=(DIR,))``):
the KV cache does not depend on the head (it only acts after the last layer), so cached prefixes
stay valid across heads.
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM

from darts_bench.surgery.heads import CorrectionHead, load_head


class DartsLlamaForCausalLM(LlamaForCausalLM):
    """vLLM ``LlamaForCausalLM`` + an optional correction head on the final hidden states.

    ``forward(input_ids [num_tokens], positions [num_tokens], ...)`` returns corrected hidden
    states ``[num_tokens, d_model]`` in the model dtype; the head computes in its own dtype
    (float32 as saved) exactly as ``CorrectionHead.forward`` does on the HF path.
    """

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.darts_head: CorrectionHead | None = None
        self.darts_head_dir = ""
        head_dir = getattr(vllm_config.model_config.hf_config, "darts_head_dir", "") or ""
        if head_dir:
            self.set_darts_head(head_dir)

    def set_darts_head(self, head_dir: str | None) -> str:
        """Load the head saved in ``head_dir`` (``save_head``'s files); ``None``/``""``: no head.

        Raises:
            ValueError: the head's ``d_model`` differs from the model's hidden size.
        """
        if not head_dir:
            self.darts_head, self.darts_head_dir = None, ""
            return ""
        head = load_head(head_dir)
        d = self.config.hidden_size
        if head.cfg.d_model != d:
            raise ValueError(f"head {head_dir}: d_model {head.cfg.d_model} != model hidden_size {d}")
        dev = next(self.parameters()).device
        self.darts_head, self.darts_head_dir = head.to(dev).eval(), str(head_dir)
        return self.darts_head_dir

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        h = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if self.darts_head is None or not isinstance(h, torch.Tensor):  # no head / not the last PP rank
            return h
        return self.darts_head(h, positions.to(h.device).long())


class DartsWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): RPCs that swap the head in place."""

    def darts_set_head(self, head_dir: str | None) -> str:
        model = self.model_runner.get_model()
        if not hasattr(model, "set_darts_head"):
            raise TypeError(f"the engine's model is {type(model).__name__}, not DartsLlamaForCausalLM")
        return model.set_darts_head(head_dir)
