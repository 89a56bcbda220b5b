"""Seeded sampling shared by the generation backends: one seed per (run seed, prompt, sample index),
so a prompt's samples are the same whatever else is in its batch, the batch size, the Ray sharding
or the one-pass grouping of heads, and a rerun draws the same samples on the same engine.

* :func:`sample_seed` — the seed of one sample (torch-free; the vLLM backend puts it in
  ``SamplingParams(seed=...)`` of a one-sample request).
* :class:`SeededSampler` — the HF backend's sampler, a ``transformers`` ``LogitsProcessor`` used
  under greedy decoding (``do_sample=False``): per sequence it applies the temperature and top-p
  (nucleus, Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration") filter with
  transformers' own ``TemperatureLogitsWarper`` / ``TopPLogitsWarper``, then draws the next token
  with that sequence's own ``torch.Generator`` by the exponential race ``argmax(p / q)``,
  ``q ~ Exp(1)`` (equivalent to a categorical draw from ``p``: the Gumbel-max trick, Gumbel 1954;
  the way vLLM samples seeded requests, ``vllm/v1/sample/ops/topk_topp_sampler.py``
  ``random_sample``), and leaves only that token for the greedy step. ``model.generate(do_sample=True)``
  cannot do this: it draws every row of a batch from the one global generator
  (``torch.multinomial``), so a sequence's sample depends on its batch.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from transformers import LogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper

#: a prompt as the backends take it: text, or token ids used as they are
Prompt = str | Sequence[int]


def sample_seed(seed: int, prompt: Prompt, index: int) -> int:
    """The seed of sample ``index`` of ``prompt`` under the call's ``seed`` (the task's seed,
    derived from the run seed): the first 63 bits of BLAKE2b over the three, a non-negative int that
    ``torch.Generator.manual_seed`` and vLLM's ``SamplingParams(seed=...)`` accept. Two prompts
    with the same text (or ids) get the same samples; a different seed, prompt or index another.

    Raises:
        ValueError: a negative ``index``.
    """
    if index < 0:
        raise ValueError(f"sample_seed: sample index must be >= 0, got {index}")
    ident = prompt if isinstance(prompt, str) else "ids:" + ",".join(str(int(t)) for t in prompt)
    h = hashlib.blake2b(f"{int(seed)}\x00{ident}\x00{int(index)}".encode("utf-8"), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


class SeededSampler(LogitsProcessor):
    """Per-sequence seeded sampling as the last logits processor of a greedy ``model.generate``.

    Args:
        seeds: one seed per sequence of the (expanded) batch, in ``generate``'s row order (prompt
            ``i``'s sample ``j`` is row ``i * num_samples + j``): :func:`sample_seed`.
        temperature: > 0, divides the logits (``TemperatureLogitsWarper``).
        top_p: in (0, 1]; below 1 keeps the smallest set of tokens whose probability sums to at least
            ``top_p`` (``TopPLogitsWarper``, at least one token).
        device: the device of the logits (the generators live there).

    Each call gets ``scores`` ``[batch, vocab]`` (float) and returns ``[batch, vocab]`` with 0 at the
    drawn token and ``-inf`` elsewhere, so the greedy step picks the draw. Every sequence draws one
    ``[vocab]`` vector of Exp(1) variates per step from its own generator, so its draws do not depend
    on the other rows (rows finished early still draw; their tokens are padding).

    Raises:
        ValueError: ``temperature <= 0``, ``top_p`` outside (0, 1], or a call whose batch is not
            ``len(seeds)`` rows.
    """

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float = 1.0, device: str | torch.device = "cpu"):
        if temperature <= 0:
            raise ValueError(f"SeededSampler: temperature must be > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"SeededSampler: top_p must be in (0, 1], got {top_p}")
        self.seeds = [int(s) for s in seeds]
        self.temperature, self.top_p = float(temperature), float(top_p)
        self._warpers = [TemperatureLogitsWarper(self.temperature)]
        if self.top_p < 1:
            self._warpers.append(TopPLogitsWarper(self.top_p))
        self._gens = [torch.Generator(device=device).manual_seed(s) for s in self.seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self._gens):
            raise ValueError(f"SeededSampler: {scores.shape[0]} rows, but {len(self._gens)} seeds")
        x = scores.float()
        for w in self._warpers:
            x = w(input_ids, x)
        probs = torch.softmax(x, dim=-1)  # [batch, vocab]; filtered tokens have probability 0
        q = torch.stack([torch.empty(probs.shape[1], device=probs.device).exponential_(generator=g)
                         for g in self._gens])  # [batch, vocab] ~ Exp(1), one generator per row
        q.clamp_min_(torch.finfo(q.dtype).tiny)  # a 0 draw would make 0 / 0 = nan for a filtered token
        token = (probs / q).argmax(dim=-1)  # [batch]
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(out.shape[0], device=out.device), token] = 0.0
        return out
