"""Every head of a merge on one HF model: requests that each name their head, served in one pass.

The rows of a merge (``ties``, ``ties+surgery``, ``ties+darts``, their seeds and sweep variants)
share the frozen transformer and differ only in the small head applied to its final hidden state
(the input of ``lm_head``), so the key/value cache of a token depends only on the tokens. A
:class:`HFMultiHeadModel` holds the merge's weights once and ``k`` heads (index ``0..k-1``; a slot
may be None: the plain merge) and serves requests ``(head index, ...)``:

* greedy :meth:`~HFMultiHeadModel.generate` (:class:`~darts_bench.api.Completion` strings with their
  finish reasons, as the row-by-row ``HFTextModel.generate``): the (head, prompt) pairs of all heads in one batched
  ``model.generate`` whose head is chosen per sequence
  (:class:`~darts_bench.surgery.corrected.MultiHeadAttachment`, as multi-LoRA serving chooses an
  adapter per request). Each head's prompts are chunked exactly as the row-by-row path chunks them
  (``batch_size`` per chunk, the same left padding), and chunks of one padded length are stacked
  over the heads, so every sequence sees the batch rows it would see alone;
* :meth:`~HFMultiHeadModel.score`: teacher-forced NLL; the transformer runs once per distinct
  (context, continuation) pair, ``lm_head`` once per block of continuation positions, and each requested
  low-rank head's logits come from those in factored form (a rank-``r`` product,
  :func:`~darts_bench.evaluate.hf_model.head_continuation_scores`), as ``HFTextModel.score`` scores
  a head row by row.

The shared checkpoint is only modified (hooked) for the duration of a call, so a plain wrapper
over the same weights (e.g. a judge) is never affected between calls.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
from torch import nn

from darts_bench.api import Completion, ScoreContinuation
from darts_bench.evaluate.memory import heap_trimmed
from darts_bench.evaluate.hf_model import (HFTextModel, completion_of, continuation_scores, factored_head_logits,
                                           finish_generated, head_continuation_scores, left_pad, kv_cache_of,
                                           prefix_chunk, score_pairs, score_plan, with_kv_cache)
from darts_bench.surgery.corrected import MultiHeadAttachment, final_norm
from darts_bench.surgery.diagnostics import HeadLogits
from darts_bench.surgery.heads import CorrectionHead, positions_from_mask

#: a request's prompt: text (tokenized like ``HFTextModel.generate``) or token ids (used as they are)
Prompt = str | Sequence[int]


class HFMultiHeadModel:
    """One merge's HF weights with ``len(heads)`` head slots (None: the plain merge), serving
    requests that name their slot (the model behind ``Backend.multi_head_model``).

    Args:
        base: the plain :class:`~darts_bench.evaluate.hf_model.HFTextModel` of the merge (its
            model, tokenizer, ``batch_size`` and ``max_length`` are used; it stays unhooked
            between calls).
        heads: one entry per slot: a :class:`~darts_bench.surgery.heads.CorrectionHead` or None.
            Slots may repeat a head (two rows with the same head): they are computed once.
        name: label (logs).
        keys: optional identity per slot (e.g. the head dir) so equal heads are recognised; by
            default slots are equal when they hold the same object (or both None).
        max_batch: greedy generation stacks chunks of equal padded length into one
            ``model.generate`` of at most this many sequences (at least one chunk; None: no cap):
            it bounds the KV cache (``evaluate.one_pass_max_batch``); float32 outputs do not depend on
            it (16-bit ones may: the stacked batches' kernels round differently,
            ``darts_bench.stages.evaluate.one_pass_exact``).

    Raises:
        ValueError: a head's ``d_model`` differs from the model's hidden size.
    """

    def __init__(self, base: HFTextModel, heads: Sequence[CorrectionHead | None], name: str = "merge",
                 keys: Sequence[object] | None = None, max_batch: int | None = None):
        self.base, self.name, self.max_batch = base, name, max_batch
        self.model, self.tokenizer = base.model, base.tokenizer
        self.batch_size, self.max_length, self.device = base.batch_size, base.max_length, base.device
        final_norm(self.model)  # fails early for an architecture without a Llama-style final norm
        self.slots = list(heads)
        uniq: list[CorrectionHead] = []
        self._slot_head: list[int | None] = []  # slot -> index into uniq (None: plain)
        seen: dict[object, int] = {}
        for i, hd in enumerate(self.slots):
            if hd is None:
                self._slot_head.append(None)
                continue
            key = keys[i] if keys is not None and keys[i] is not None else id(hd)
            if key not in seen:
                seen[key] = len(uniq)
                uniq.append(hd)
            self._slot_head.append(seen[key])
        self._heads = uniq
        d = self.model.config.hidden_size
        for i, hd in enumerate(uniq):
            if hd.cfg.d_model != d:
                raise ValueError(f"{name}: head {i} d_model {hd.cfg.d_model} != model hidden_size {d}")
            hd.to(self.device).eval()

    @classmethod
    def from_head_dirs(cls, base: HFTextModel, head_dirs: Sequence[str | None], name: str = "merge",
                       max_batch: int | None = None) -> "HFMultiHeadModel":
        """Slots from saved heads: each distinct dir loaded once (``load_head``), a None entry the
        plain merge, the dirs as the slots' keys (so equal dirs share one head).

        Raises:
            FileNotFoundError / ValueError: a missing or corrupt head; see the constructor.
        """
        from darts_bench.surgery.heads import load_head

        dirs = [str(h) if h else None for h in head_dirs]
        loaded = {d: load_head(d) for d in dict.fromkeys(d for d in dirs if d)}
        return cls(base, [loaded[d] if d else None for d in dirs], name=name, keys=dirs, max_batch=max_batch)

    @property
    def n_heads(self) -> int:
        return len(self.slots)

    def format_chat(self, user_message: str) -> str:
        return self.base.format_chat(user_message)

    def close(self) -> None:
        """Nothing to release: the weights belong to whoever loaded ``base``; hooks live per call."""

    def _check(self, idx: int | None) -> None:
        if idx is not None and not 0 <= idx < len(self.slots):
            raise ValueError(f"{self.name}: head index {idx} out of range ({len(self.slots)} slots; None = plain)")

    def _head_of(self, idx: int | None) -> int | None:
        self._check(idx)
        return None if idx is None else self._slot_head[idx]

    # --------------------------------------------------------------- generation
    @heap_trimmed
    @torch.inference_mode()
    def generate_finished(self, requests: Sequence[tuple[int | None, Prompt]], *, max_new_tokens: int,
                          stop: Sequence[str] = (), num_samples: int = 1, temperature: float = 0.0,
                          top_p: float = 1.0, seed: int = 0) -> list[list[tuple[list[int], bool]]]:
        """Per request, ``[sample]`` pairs ``(generated ids, ended at an eos id)``, as
        ``HFTextModel.generate_finished``.

        Greedy (``temperature == 0``): each slot's prompts (its requests in order) are chunked by
        ``batch_size`` as the row-by-row path chunks them; equal (head, chunk) pairs are generated
        once, and chunks of equal padded length are stacked into one ``model.generate`` call (up to
        ``max_batch`` sequences) with the head chosen per sequence, so float32 outputs equal the
        row-by-row path's token for token (test: ``tests/test_evaluate_one_pass.py``; in bfloat16 the
        larger stacked batches round differently: ``results/device/eval-heads-h200``). Sampled (``temperature > 0``): one head at a time,
        exactly the row-by-row call (the same chunks and per-sample seeds
        :func:`~darts_bench.evaluate.sampling.sample_seed`), so samples equal the row-by-row path's.

        Raises:
            ValueError: a head index out of range; greedy with ``num_samples != 1``.
        """
        by_slot: dict[int | None, list[int]] = defaultdict(list)  # slot -> request indices, in order
        for r, (idx, _) in enumerate(requests):
            self._check(idx)
            by_slot[idx].append(r)
        out: list[list[tuple[list[int], bool]] | None] = [None] * len(requests)
        if temperature > 0:
            for idx, rs in by_slot.items():
                with self._hooked() as att:
                    att.rows = self._head_of(idx)
                    gens = self.base.generate_finished([requests[r][1] for r in rs], max_new_tokens=max_new_tokens,
                                                       stop=stop, num_samples=num_samples, temperature=temperature,
                                                       top_p=top_p, seed=seed)
                for r, g in zip(rs, gens):
                    out[r] = g
            return out  # type: ignore[return-value]
        if top_p != 1.0:
            raise ValueError(f"top_p={top_p} needs sampling (temperature > 0)")
        gen_cfg = self.base._generation_config(max_new_tokens, stop, num_samples, temperature)
        # the row-by-row chunks: (head, chunk prompts) -> the request indices it serves (per slot)
        chunks: dict[tuple, list[list[int]]] = {}
        for idx, rs in by_slot.items():
            hd = self._head_of(idx)
            for s in range(0, len(rs), self.batch_size):
                part = rs[s:s + self.batch_size]
                key = (hd, tuple(p if isinstance(p, str) else tuple(p) for p in (requests[r][1] for r in part)))
                chunks.setdefault(key, []).append(part)
        encoded = {key: self.base._encode_batch([requests[r][1] for r in parts[0]]) for key, parts in chunks.items()}
        by_len: dict[int, list[tuple]] = defaultdict(list)  # padded length -> chunks stacked in one call
        for key, enc in encoded.items():
            by_len[enc["input_ids"].shape[1]].append(key)
        calls: list[tuple[int, list[tuple]]] = []  # (padded length, chunks), at most max_batch sequences a call
        for L, keys in by_len.items():
            calls.append((L, []))
            n = 0
            for k in keys:
                size = encoded[k]["input_ids"].shape[0]
                if calls[-1][1] and self.max_batch is not None and n + size > self.max_batch:
                    calls.append((L, []))
                    n = 0
                calls[-1][1].append(k)
                n += size
        eos_ids, pad = self.base._eos_ids(), self.tokenizer.pad_token_id
        for L, keys in calls:
            ids = torch.cat([encoded[k]["input_ids"] for k in keys])  # [sum of chunk sizes, L]
            mask = torch.cat([encoded[k]["attention_mask"] for k in keys])
            rows = [k[0] for k in keys for _ in range(encoded[k]["input_ids"].shape[0])]
            with self._hooked() as att:
                att.rows = rows
                seqs = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                           tokenizer=self.tokenizer if stop else None)
            new = seqs[:, L:].tolist()
            i = 0
            for k in keys:
                n = encoded[k]["input_ids"].shape[0]
                gens = [[finish_generated(s, eos_ids, pad)] for s in new[i:i + n]]
                i += n
                for part in chunks[k]:
                    for r, g in zip(part, gens):
                        out[r] = g
        return out  # type: ignore[return-value]

    def generate_ids(self, requests: Sequence[tuple[int | None, Prompt]], *, max_new_tokens: int,
                     stop: Sequence[str] = (), num_samples: int = 1, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0) -> list[list[list[int]]]:
        """Generated ids per request, ``[request][sample][token]`` (as ``HFTextModel.generate_ids``):
        :meth:`generate_finished` without the eos flags."""
        return [[ids for ids, _ in row] for row in self.generate_finished(
            requests, max_new_tokens=max_new_tokens, stop=stop, num_samples=num_samples, temperature=temperature,
            top_p=top_p, seed=seed)]

    def generate(self, requests: Sequence[tuple[int | None, Prompt]], *, max_new_tokens: int,
                 stop: Sequence[str] = (), num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[Completion]]:
        """Continuations per request, ``[request][sample]`` :class:`~darts_bench.api.Completion`
        strings cut before the first stop sequence, with their finish reasons
        (:meth:`generate_finished` decoded as ``HFTextModel.generate`` decodes:
        :func:`~darts_bench.evaluate.hf_model.completion_of`)."""
        gens = self.generate_finished(requests, max_new_tokens=max_new_tokens, stop=stop, num_samples=num_samples,
                                      temperature=temperature, top_p=top_p, seed=seed)
        return [[completion_of(self.tokenizer, ids, eos, stop) for ids, eos in row] for row in gens]

    def prompt_states(self, prompts: Sequence[str]) -> torch.Tensor:
        """The plain merge's mean-pooled prompt states, ``[n, d_model]`` float32
        (:meth:`HFTextModel.prompt_states` of ``base``, which is unhooked between calls): what a
        routed row's router reads."""
        return self.base.prompt_states(prompts)

    # ------------------------------------------------------------------ scoring
    @heap_trimmed
    @torch.inference_mode()
    def score(self, requests: Sequence[tuple[int | None, str, str]]) -> list[ScoreContinuation]:
        """Teacher-forced NLL (nats) of each request's continuation given its context under its
        head, lm-eval's tokenization (:func:`~darts_bench.evaluate.hf_model.score_pairs`).

        The distinct (context, continuation) pairs, in first-request order (longest first when the
        base model's ``score_by_length`` is set: :func:`~darts_bench.evaluate.hf_model.score_order`),
        run through the transformer (``model.model``: embeddings, layers, final norm) once per chunk of
        ``batch_size`` pairs, left-padded with ``position_ids`` from the mask as
        ``HFTextModel.score`` (the same :func:`~darts_bench.evaluate.hf_model.score_plan`; with the base
        model's ``share_prefix``, pairs sharing a context as its prefix chunks: the prefix once with its
        KV cache, then each pair's remaining tokens). ``lm_head`` then runs once per block of the positions
        that predict continuation tokens, on the cached final hidden states ``[batch, seq, d_model]``,
        and every head requested for a pair of the chunk gets its logits from those: a low-rank float32
        head (:func:`~darts_bench.evaluate.hf_model.factored_head_logits`) in factored form, ``W h -
        (W U) relu(D h) + (W b)[p]`` (:class:`~darts_bench.surgery.diagnostics.HeadLogits`, one per head
        and call), so a further head costs a rank-``r`` product and its float32 log-softmax, not a
        ``[positions, d_model] x [d_model, vocab]`` product
        (:func:`~darts_bench.evaluate.hf_model.head_continuation_scores`); any other head is applied to the
        whole chunk's hidden states (as its hook does in the row-by-row forward) before ``lm_head``
        (:func:`~darts_bench.evaluate.hf_model.continuation_scores`). ``HFTextModel.score`` scores a head the
        same way, so values equal the row-by-row path's bitwise when a row scores the same pairs (tested);
        the factored values are rounding-level apart from the head-then-``lm_head`` ones
        (:func:`~darts_bench.evaluate.hf_model.factored_head_logits` says how far).

        Raises:
            ValueError: a head index out of range, an empty continuation.
        """
        for idx, _, _ in requests:
            self._check(idx)
        distinct: dict[tuple[str, str], int] = {}
        for _, c, x in requests:
            distinct.setdefault((c, x), len(distinct))
        pairs = score_pairs(self.tokenizer, [c for c, _ in distinct], [x for _, x in distinct], self.max_length)
        wanted: dict[int, set[int | None]] = defaultdict(set)  # pair -> heads asked for it
        for idx, c, x in requests:
            wanted[distinct[(c, x)]].add(self._head_of(idx))
        body, lm_head = self.model.model, self.model.get_output_embeddings()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        per: dict[tuple[int, int | None], ScoreContinuation] = {}
        pad = self.tokenizer.pad_token_id
        # heads scored in factored form (as HFTextModel.score scores them row by row), one HeadLogits per call
        factored = {k: HeadLogits(hd, lm_head.weight) for k, hd in enumerate(self._heads)
                    if any(k in w for w in wanted.values()) and factored_head_logits(self.model, hd)}

        def apply(idx, h, pos, input_ids, n_cont, ends, head_states):
            """Every head asked for the chunk's pairs ``idx``: the plain merge and the factored heads from one
            ``lm_head`` per block (head_continuation_scores) on the plain states ``h``, any other head on
            ``head_states(head)``, its hidden states as its hook gives them row by row, before ``lm_head``."""
            order = sorted({k for i in idx for k in wanted[i]}, key=lambda k: -1 if k is None else k)  # plain first
            fk = [k for k in order if k is None or k in factored]
            got = dict(zip(fk, head_continuation_scores(h, input_ids, n_cont, lm_head, [factored.get(k) for k in fk],
                                                        positions=pos, softcap=cap, ends=ends) if fk else []))
            for k in order:
                scores = got[k] if k in got else continuation_scores(head_states(k), input_ids, n_cont, lm_head, cap,
                                                                     ends=ends)
                for i, sc in zip(idx, scores):
                    per[(i, k)] = sc

        # the row-by-row HFTextModel.score's chunks (score_by_length, share_prefix)
        for kind, part in score_plan(pairs, self.batch_size, self.base.score_by_length, self.base.share_prefix):
            if kind == "prefix":  # a shared prefix once with its KV cache, then each pair's remaining tokens
                x = prefix_chunk(pairs, part, pad, self.device)
                out = body(input_ids=x.prefix_ids, attention_mask=x.prefix_mask, position_ids=x.prefix_pos,
                           use_cache=True)
                h_p, cache = out.last_hidden_state, kv_cache_of(out)  # [groups, prefix, d_model]
                cache.reorder_cache(x.group_of)
                h_s = body(input_ids=x.suffix_ids, attention_mask=x.mask, position_ids=x.suffix_pos, use_cache=True,
                           **with_kv_cache(body, cache)).last_hidden_state  # [pairs, suffix, d_model]
                # an unfactored head on each forward's whole output, as its hook does in the row-by-row forwards
                apply([i for g in part for i in g[1]], torch.cat([h_p[x.group_of], h_s], 1),
                      torch.cat([x.prefix_pos[x.group_of], x.suffix_pos], 1), x.input_ids, x.n_cont, x.ends,
                      lambda hd: torch.cat([self._heads[hd](h_p, x.prefix_pos)[x.group_of],
                                            self._heads[hd](h_s, x.suffix_pos)], 1))
                continue
            chunk = [pairs[i] for i in part]
            input_ids, mask = left_pad([ids for ids, _ in chunk], pad)
            input_ids = input_ids.to(self.device)
            pos = positions_from_mask(mask).to(self.device)
            h = body(input_ids=input_ids, attention_mask=mask.to(self.device),
                     position_ids=pos).last_hidden_state  # [batch, seq, d_model], after the final norm: once
            # an unfactored head on the whole chunk, as its hook does in the row-by-row forward
            apply(part, h, pos, input_ids, [n for _, n in chunk], None, lambda hd: self._heads[hd](h, pos))
        return [per[(distinct[(c, x)], self._head_of(idx))] for idx, c, x in requests]

    # ------------------------------------------------------------------ hooks
    def _hooked(self):
        return _Hooked(self.model, self._heads)


class _Hooked:
    """Context manager: a :class:`MultiHeadAttachment` on ``model`` for one call."""

    def __init__(self, model: nn.Module, heads: list[CorrectionHead]):
        self.model, self.heads = model, heads
        self.att: MultiHeadAttachment | None = None

    def __enter__(self) -> MultiHeadAttachment:
        self.att = MultiHeadAttachment(self.model, self.heads)
        return self.att

    def __exit__(self, *exc) -> None:
        self.att.remove()
