"""A Hugging Face causal LM (optionally with a correction head) behind the :class:`TextModel` API.

Generation is ``model.generate`` batched with left padding and the KV cache; stop sequences are
handled by transformers' ``stop_strings`` and the text is cut at the first stop sequence. Each
continuation is a :class:`~darts_bench.api.Completion` (text + finish reason ``stop`` | ``length``:
:func:`completion_of`). Sampling (temperature, top_p) is greedy decoding over the
:class:`~darts_bench.evaluate.sampling.SeededSampler` logits processor, one seed per (seed, prompt,
sample index), so samples do not depend on the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from darts_bench.api import Completion, ScoreContinuation
from darts_bench.evaluate.memory import heap_trimmed
from darts_bench.evaluate.prefix_cache import blocks_supported, kv_cache_of, with_kv_cache  # noqa: F401 (re-exported)
from darts_bench.evaluate.sampling import SeededSampler, sample_seed
from darts_bench.surgery.corrected import attach_head, final_norm
from darts_bench.surgery.heads import CorrectionHead, positions_from_mask
from darts_bench.surgery.diagnostics import HeadLogits
from darts_bench.surgery.losses import first_argmax

DEFAULT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"


def check_checkpoint(path: str | Path) -> None:
    """Fail early, naming the file, if a local checkpoint dir lacks its config, its weights or a shard
    its ``model.safetensors.index.json`` lists, or if a safetensors file is truncated or corrupt (its
    header and tensor byte ranges are checked).

    Raises:
        FileNotFoundError: no config.json / no weights / a listed shard missing; ValueError: a corrupt
            safetensors file.
    """
    import json

    from safetensors import safe_open

    from darts_bench.pool.checkpoint import check_safetensors_length

    p = Path(path)
    if not p.exists():
        return  # a hub id: transformers resolves it
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"not a model checkpoint (no config.json): {p}")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        missing = sorted({f for f in json.loads(index.read_text()).get("weight_map", {}).values()
                          if not (p / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{p}: shards {missing} listed in model.safetensors.index.json are missing")
    files = sorted(p.glob("*.safetensors"))
    if not files and not any(p.glob("*.bin")):
        raise FileNotFoundError(f"no weights (*.safetensors) in checkpoint dir {p}")
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    st.get_slice(k)
            check_safetensors_length(f)
        except Exception as e:  # noqa: BLE001 - any failure here means the file is unusable
            raise ValueError(f"corrupt safetensors file {f}: {e}; re-download or rebuild it "
                             "(darts-bench rebuilds artifacts in its work dir when their manifest check fails)") from None


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load ``(model, tokenizer)`` from a checkpoint dir; the tokenizer pads on the left.

    Raises:
        FileNotFoundError: ``path`` is missing or has no config/weights; ValueError: corrupt weights.
    """
    check_checkpoint(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    return model, tok


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask``, both ``[batch, max_len]`` int64."""
    L = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), L), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, L - len(s):] = torch.tensor(list(s), dtype=torch.long)
        mask[i, L - len(s):] = 1
    return ids, mask


def strip_generated(ids: Sequence[int], eos_ids: set[int], pad_id: int | None) -> list[int]:
    """Generated ids up to (excluding) the first eos, then without trailing ``pad_id`` (the padding
    ``generate`` appends once a row has finished). A pad id inside the text is kept: when it is an
    ordinary token (a model without a dedicated pad), generating it does not end the sequence."""
    out = list(ids)
    for j, t in enumerate(out):
        if t in eos_ids:
            out = out[:j]
            break
    while out and pad_id is not None and out[-1] == pad_id and pad_id not in eos_ids:
        out.pop()
    return out


def finish_generated(ids: Sequence[int], eos_ids: set[int], pad_id: int | None) -> tuple[list[int], bool]:
    """``(generated ids as strip_generated gives them, whether an eos id ended them)`` for one row of
    ``model.generate``'s new tokens (the ``stop`` half of a finish reason; the stop-sequence half
    is read from the decoded text: :func:`completion_of`)."""
    return strip_generated(ids, eos_ids, pad_id), any(t in eos_ids for t in ids)


def completion_of(tokenizer, ids: Sequence[int], hit_eos: bool, stop: Sequence[str]) -> Completion:
    """The :class:`~darts_bench.api.Completion` of generated ``ids``: decoded (special tokens
    skipped) and cut before the first stop sequence; ``finish_reason`` ``stop`` when an eos token
    ended the ids (``hit_eos``) or a stop sequence occurs in the text, else ``length`` (generation
    ran to ``max_new_tokens``: a row of ``model.generate`` that has neither is not finished, so it
    ran to the cap); ``n_tokens`` = ``len(ids)``."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    text = cut_at_stop(full, stop)
    return Completion(text, "stop" if hit_eos or len(text) < len(full) else "length", len(ids))


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to (excluding) the earliest occurrence of any stop sequence."""
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
    return text[:cut]


def format_chat(tokenizer, user_message: str) -> str:
    """``user_message`` in the tokenizer's chat template with the generation prompt appended; the
    Alpaca ``### Instruction / ### Response`` format when the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True)
    return DEFAULT_TEMPLATE.format(instruction=user_message)


class PromptFormatter:
    """The formatting part of a TextModel (no weights): enough for ``Task.examples``."""

    def __init__(self, tokenizer, name: str = "formatter"):
        self.tokenizer, self.name = tokenizer, name

    def format_chat(self, user_message: str) -> str:
        return format_chat(self.tokenizer, user_message)


def score_pairs(tokenizer, contexts: Sequence[str], continuations: Sequence[str],
                max_length: int) -> list[tuple[list[int], int]]:
    """``(token ids, number of scored continuation tokens)`` per (context, continuation), as
    lm-eval tokenizes them: each part separately, concatenated, the context cut from the left to fit
    ``max_length`` tokens. Shared by every backend's ``score``.

    Raises:
        ValueError: different numbers of contexts and continuations, or an empty continuation.
    """
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts vs {len(continuations)} continuations")
    pairs = []
    for ctx, cont in zip(contexts, continuations):
        c_ids = tokenizer(ctx, add_special_tokens=True)["input_ids"]
        x_ids = tokenizer(cont, add_special_tokens=False)["input_ids"]
        if not x_ids:
            raise ValueError(f"empty continuation for context {ctx[:60]!r}")
        ids = (c_ids + x_ids)[-max_length:]
        pairs.append((ids, min(len(x_ids), len(ids) - 1)))
    return pairs


class HFTextModel:
    """:class:`darts_bench.api.TextModel` over an HF causal LM and tokenizer.

    Args:
        name: row name (``base``, ``expert:code``, ``ties+darts`` ...).
        model, tokenizer: loaded HF objects (tokenizer padding side is forced to ``left``).
        head: optional correction head, attached for the lifetime of this wrapper.
        batch_size: prompts per ``generate`` / forward call.
        max_length: prompts (and scored context + continuation) longer than this many tokens are
            truncated from the left; default ``min(1024, config.max_position_embeddings)``, so a
            model never sees positions it was not trained on.
        score_by_length: :meth:`score` chunks its pairs longest first (:func:`score_order`), so a
            chunk pads little, instead of in the given order (the hf backend's default: its values
            are the reference). Values then differ from the given order's at rounding level.
        share_prefix: :meth:`score` forwards a context that two or more distinct pairs of the call
            share (the AlpacaEval judge's two verdicts, a multiple-choice question's options) once,
            with its KV cache, and then only each pair's remaining tokens (:func:`score_plan`).
            Values differ from the full forward's at rounding level (tested within 1e-6 relative).
        prefix_cache: with ``share_prefix`` and no head, the shared prefixes' whole
            :data:`~darts_bench.evaluate.prefix_cache.PREFIX_BLOCK_TOKENS`-token blocks come from this
            :class:`~darts_bench.evaluate.prefix_cache.PrefixBlockCache` (computed block by block and kept
            for later calls; the rest of each prefix is forwarded with the pair's own tokens). Values
            do not depend on what it holds; they differ from ``share_prefix`` alone at rounding level.
            Ignored for a model with sliding-window layers
            (:func:`~darts_bench.evaluate.prefix_cache.blocks_supported`).
    """

    def __init__(self, name: str, model: PreTrainedModel, tokenizer, head: CorrectionHead | None = None,
                 batch_size: int = 8, max_length: int | None = None, score_by_length: bool = False,
                 share_prefix: bool = False, prefix_cache=None):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.tokenizer.padding_side = "left"
        self.tokenizer.truncation_side = "left"  # keep the end of an over-long prompt
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.head = head
        self._attachment = attach_head(model, head) if head is not None else None
        if max_length is None:
            max_length = min(1024, getattr(model.config, "max_position_embeddings", None) or 1024)
        self.batch_size, self.max_length, self.score_by_length = batch_size, max_length, score_by_length
        self.share_prefix = share_prefix
        self.prefix_cache = prefix_cache
        self.device = next(model.parameters()).device

    def close(self) -> None:
        if self._attachment is not None:
            self._attachment.remove()
            self._attachment = None

    # ------------------------------------------------------------------ prompts
    def format_chat(self, user_message: str) -> str:
        return format_chat(self.tokenizer, user_message)

    def _encode(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=True,
                             truncation=True, max_length=self.max_length)
        return {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

    def _encode_batch(self, batch: Sequence[str] | Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """One chunk of prompts as ``generate`` gets it: ``input_ids`` / ``attention_mask``
        ``[batch, max_len]`` int64, left-padded (strings tokenized with truncation to ``max_length``)."""
        if batch and not isinstance(batch[0], str):
            ids, mask = left_pad(batch, self.tokenizer.pad_token_id)
            return {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        return self._encode(batch)

    def _generation_config(self, max_new_tokens: int, stop: Sequence[str], num_samples: int,
                           temperature: float) -> GenerationConfig:
        """The ``GenerationConfig`` of one call: always greedy decoding with one sequence per input
        row; sampling is the :class:`~darts_bench.evaluate.sampling.SeededSampler` logits processor
        (:meth:`_sampler`) on rows repeated ``num_samples`` times, so every sample has its own seed.

        Raises:
            ValueError: greedy (``temperature == 0``) with ``num_samples != 1``; ``num_samples < 1``.
        """
        if temperature == 0.0 and num_samples != 1:
            raise ValueError("greedy decoding (temperature 0) gives one sample; set temperature > 0")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        return GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
            num_return_sequences=1, pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.model.generation_config.eos_token_id, stop_strings=list(stop) or None)

    def _sampler(self, batch: Sequence[str] | Sequence[Sequence[int]], num_samples: int, temperature: float,
                 top_p: float, seed: int):
        """``logits_processor`` for ``model.generate`` on ``batch`` with each prompt repeated
        ``num_samples`` times (row ``i * num_samples + j``: prompt ``i``'s sample ``j``, seeded by
        ``sample_seed(seed, prompt, j)``); None when greedy."""
        if temperature == 0.0:
            if top_p != 1.0:
                raise ValueError(f"top_p={top_p} needs sampling (temperature > 0)")
            return None
        from transformers import LogitsProcessorList

        seeds = [sample_seed(seed, p, j) for p in batch for j in range(num_samples)]
        return LogitsProcessorList([SeededSampler(seeds, temperature, top_p, device=self.device)])

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()

    # --------------------------------------------------------------- generation
    @heap_trimmed
    @torch.inference_mode()
    def generate_finished(self, prompts: Sequence[str] | Sequence[Sequence[int]], *, max_new_tokens: int,
                          stop: Sequence[str] = (), num_samples: int = 1, temperature: float = 0.0,
                          top_p: float = 1.0, seed: int = 0) -> list[list[tuple[list[int], bool]]]:
        """``[prompt][sample]`` pairs ``(generated ids, ended at an eos id)`` (ids as
        :meth:`generate_ids`). Prompts run in chunks of ``batch_size`` (the chunking every path
        that must match this one copies); a sampled chunk's prompts are each repeated
        ``num_samples`` times and every row draws from its own seed (:meth:`_sampler`), so samples
        do not depend on the chunking, the batch size or the other prompts (up to the float
        rounding of a different padded batch)."""
        gen_cfg = self._generation_config(max_new_tokens, stop, num_samples, temperature)
        out: list[list[tuple[list[int], bool]]] = []
        eos_ids, pad = self._eos_ids(), self.tokenizer.pad_token_id
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start:start + self.batch_size]
            enc = self._encode_batch(batch)
            sampler = self._sampler(batch, num_samples, temperature, top_p, seed)
            if num_samples > 1:
                enc = {k: v.repeat_interleave(num_samples, dim=0) for k, v in enc.items()}
            seqs = self.model.generate(**enc, generation_config=gen_cfg, logits_processor=sampler,
                                       tokenizer=self.tokenizer if stop else None)
            new = seqs[:, enc["input_ids"].shape[1]:].tolist()
            for i in range(len(batch)):
                out.append([finish_generated(s, eos_ids, pad) for s in new[i * num_samples:(i + 1) * num_samples]])
        return out

    def generate_ids(self, prompts: Sequence[str] | Sequence[Sequence[int]], *, max_new_tokens: int,
                     stop: Sequence[str] = (), num_samples: int = 1, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0) -> list[list[list[int]]]:
        """Generated token ids (prompt excluded, cut at the first eos, trailing padding stripped:
        :func:`strip_generated`), ``[prompt][sample][token]``.
        ``prompts`` are strings (tokenized here) or token-id lists (used as they are);
        :meth:`generate_finished` without the eos flags."""
        return [[ids for ids, _ in row] for row in self.generate_finished(
            prompts, max_new_tokens=max_new_tokens, stop=stop, num_samples=num_samples, temperature=temperature,
            top_p=top_p, seed=seed)]

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, stop: Sequence[str] = (),
                 num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[Completion]]:
        """``[prompt][sample]`` :class:`~darts_bench.api.Completion` strings (decoded, cut before the
        first stop sequence, with ``finish_reason`` and ``n_tokens``: :func:`completion_of`)."""
        gens = self.generate_finished(prompts, max_new_tokens=max_new_tokens, stop=stop, num_samples=num_samples,
                                      temperature=temperature, top_p=top_p, seed=seed)
        return [[completion_of(self.tokenizer, ids, eos, stop) for ids, eos in row] for row in gens]

    # ------------------------------------------------------------------ routing
    @torch.inference_mode()
    def prompt_states(self, prompts: Sequence[str]) -> "torch.Tensor":
        """The model's final hidden state (after the last norm, the input of ``lm_head``; any attached
        head's hook included) mean-pooled over each prompt's tokens: ``[n, d_model]`` float32.

        Prompts are tokenized as :meth:`generate` tokenizes them and run in its chunks of
        ``batch_size`` (left-padded, ``position_ids`` from the mask), so every path that routes the
        same prompt list computes the same values (:mod:`darts_bench.surgery.routing`).

        Raises:
            ValueError: the architecture has no Llama-style final norm.
        """
        norm = final_norm(self.model)
        out = []
        for start in range(0, len(prompts), self.batch_size):
            enc = self._encode(prompts[start:start + self.batch_size])
            grab: dict[str, torch.Tensor] = {}

            def keep(module, args, output):
                grab["h"] = output[0] if isinstance(output, tuple) else output

            hd = norm.register_forward_hook(keep)
            try:
                self.model(**enc, position_ids=positions_from_mask(enc["attention_mask"]).to(self.device),
                           logits_to_keep=1)
            finally:
                hd.remove()
            m = enc["attention_mask"].to(grab["h"].dtype).unsqueeze(-1)  # [batch, seq, 1]
            out.append(((grab["h"] * m).sum(1) / m.sum(1)).float().cpu())  # [batch, d_model]
        return torch.cat(out) if out else torch.zeros(0, self.model.config.hidden_size)

    # ------------------------------------------------------------------ scoring
    @heap_trimmed
    @torch.inference_mode()
    def score(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[ScoreContinuation]:
        """Per-pair NLL of the continuation tokens given the context (lm-eval's convention:
        context and continuation are tokenized separately and concatenated; the context is
        truncated from the left to fit ``max_length``). Batches are left-padded with ``position_ids``
        from the attention mask, so a pair's NLL depends on the pairs batched with it only at rounding level.
        The final hidden states are read at the final norm (after the head's hook, if any);
        ``lm_head`` runs only at the positions that predict continuation tokens
        (:func:`head_continuation_scores`, shared with the one-pass ``HFMultiHeadModel.score``); a
        low-rank float32 head (:func:`factored_head_logits`) is read before its hook and its logits
        taken in factored form from the plain ones (rounding-level apart from the head-then-``lm_head``
        values: :func:`factored_head_logits`; bitwise the one pass's). Chunks
        take the pairs in :func:`score_order` (``score_by_length``); with ``share_prefix`` the pairs
        that share a context run as :func:`score_plan`'s prefix chunks (:func:`prefix_chunk`: the
        shared prefix once, with its KV cache, then each pair's remaining tokens). Results are in the
        given order."""
        pairs = score_pairs(self.tokenizer, contexts, continuations, self.max_length)
        results: list[ScoreContinuation | None] = [None] * len(pairs)
        pad = self.tokenizer.pad_token_id
        lm_head = self.model.get_output_embeddings()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        try:
            norm = final_norm(self.model)
        except ValueError:
            norm = None  # not Llama-style: the full forward's logits
        hidden = norm is not None and lm_head is not None
        grab: dict[str, torch.Tensor] = {}
        # a low-rank head's logits in factored form (head_continuation_scores): the final norm's output is
        # read before the head's hook (prepended), and the head applied to the logits; else after the hook
        factored = hidden and factored_head_logits(self.model, self.head)
        heads = [HeadLogits(self.head, lm_head.weight)] if factored else [None]

        def keep(module, args, output):  # the final hidden state: corrected by any head hook unless factored
            grab["h"] = output[0] if isinstance(output, tuple) else output

        def final_states(**kw):  # [batch, seq, d_model] and the forward's KV cache (with use_cache)
            hd = norm.register_forward_hook(keep, prepend=factored)
            try:
                out = self.model(**kw, logits_to_keep=1)  # the head's hooks see this forward's mask
            finally:
                hd.remove()
            return grab.pop("h"), kv_cache_of(out)

        blocks = self.prefix_cache if self.head is None and self.prefix_cache is not None \
            and blocks_supported(self.model) else None
        plan = score_plan(pairs, self.batch_size, self.score_by_length, self.share_prefix and hidden)
        if blocks is not None:  # every prefix chunk's missing blocks first, batched across the call
            blocks.prefetch(self.model, final_states, [pairs[m[0]][0][:blocks.cut(P)] for kind, part in plan
                                                       if kind == "prefix" for P, m in part if blocks.cut(P)])
        for kind, part in plan:
            if kind == "prefix":
                if blocks is not None:  # the prefixes' whole blocks from the cache, the rest with each pair
                    part = [(blocks.cut(P), m) for P, m in part]
                x = prefix_chunk(pairs, part, pad, self.device)
                if blocks is not None and any(P for P, _ in part):
                    h_p, cache = blocks.states(self.model, final_states, [pairs[m[0]][0][:P] for P, m in part])
                elif blocks is not None:  # no whole block: each sequence forwarded from its first token
                    h_p, cache = None, None
                else:
                    h_p, cache = final_states(input_ids=x.prefix_ids, attention_mask=x.prefix_mask,
                                              position_ids=x.prefix_pos, use_cache=True)
                kv = {}
                if cache is not None:
                    cache.reorder_cache(x.group_of)  # one copy of its group's prefix cache per pair
                    kv = with_kv_cache(self.model, cache)
                h_s, _ = final_states(input_ids=x.suffix_ids, attention_mask=x.mask, position_ids=x.suffix_pos,
                                      use_cache=True, **kv)
                pos = torch.cat([x.prefix_pos[x.group_of], x.suffix_pos], 1) if factored else None  # (a head: no blocks)
                got = head_continuation_scores(h_s if h_p is None else torch.cat([h_p[x.group_of], h_s], 1),
                                               x.input_ids, x.n_cont, lm_head, heads, positions=pos, softcap=cap,
                                               ends=x.ends)[0]
                idx = [i for g in part for i in g[1]]
                for i, sc in zip(idx, got):
                    for j in x.same[i]:
                        results[j] = sc
                continue
            idx = part
            chunk = [pairs[i] for i in idx]
            input_ids, mask = left_pad([ids for ids, _ in chunk], pad)  # left padding, like generation
            kw = {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device),
                  "position_ids": positions_from_mask(mask).to(self.device)}
            if hidden:
                got = head_continuation_scores(final_states(**kw)[0], kw["input_ids"], [n for _, n in chunk], lm_head,
                                               heads, positions=kw["position_ids"], softcap=cap)[0]
            else:
                logits = self.model(**kw).logits
                got = _scores_from_logits(logits, kw["input_ids"], [n for _, n in chunk])
            for i, sc in zip(idx, got):
                results[i] = sc
        return results  # type: ignore[return-value]


def score_plan(pairs: Sequence[tuple[Sequence[int], int]], batch_size: int, by_length: bool,
               share_prefix: bool) -> list[tuple[str, list]]:
    """The chunks in which ``score`` runs ``pairs`` (``(token ids, n)`` of :func:`score_pairs`),
    shared by ``HFTextModel.score`` and the one-pass ``HFMultiHeadModel.score`` so that both batch
    a pair with the same others.

    Without ``share_prefix``: ``("full", [pair index, ...])`` chunks of ``batch_size`` pairs in
    :func:`score_order`. With it, the pairs whose context tokens (``ids[:-n]``) are equal and that
    hold at least two distinct token sequences form a group; a group's prefix is the longest token
    prefix its distinct sequences share (at most the shortest one's length - 1, so each keeps a token
    to forward). Groups, longest prefix first when ``by_length`` (else in first-pair order), are
    packed into ``("prefix", [(prefix length, [pair index of each distinct sequence, ...]), ...])``
    chunks of at most ``batch_size`` sequences (at least one group); the other pairs form "full"
    chunks as above, after the prefix chunks. A repeated pair is listed once (the first).
    """
    if not share_prefix:
        order = score_order(pairs, by_length)
        return [("full", order[s:s + batch_size]) for s in range(0, len(order), batch_size)]
    by_ctx: dict[tuple[int, ...], dict[tuple[int, ...], int]] = {}
    for i, (ids, n) in enumerate(pairs):
        by_ctx.setdefault(tuple(ids[:len(ids) - n]), {}).setdefault(tuple(ids), i)
    groups: list[tuple[int, list[int]]] = []
    grouped: set[int] = set()
    for seqs in by_ctx.values():
        if len(seqs) < 2:
            continue
        members = list(seqs.values())
        ids = [pairs[i][0] for i in members]
        limit = min(len(x) for x in ids) - 1
        P = 0
        while P < limit and all(x[P] == ids[0][P] for x in ids):
            P += 1
        groups.append((P, members))
        grouped.update(members)
    if by_length:
        groups.sort(key=lambda g: -g[0])
    plan: list[tuple[str, list]] = []
    cur: list[tuple[int, list[int]]] = []
    for g in groups:
        if cur and sum(len(m) for _, m in cur) + len(g[1]) > batch_size:
            plan.append(("prefix", cur))
            cur = []
        cur.append(g)
    if cur:
        plan.append(("prefix", cur))
    key = {ids: i for ctx in by_ctx.values() for ids, i in ctx.items()}
    # a repeat of a full-chunk pair is scored again in its own place (as without share_prefix)
    rest = [i for i in score_order(pairs, by_length) if i not in grouped
            and key[tuple(pairs[i][0])] not in grouped]
    return plan + [("full", rest[s:s + batch_size]) for s in range(0, len(rest), batch_size)]


class PrefixChunk:
    """The tensors of one ``("prefix", groups)`` chunk of :func:`score_plan` (``G`` groups, ``M``
    sequences; built by :func:`prefix_chunk`), all int64 on the model's device:

    * ``prefix_ids`` / ``prefix_mask`` / ``prefix_pos`` ``[G, P]``: each group's shared prefix, left-padded
      to the longest (``P``), ``position_ids`` from the mask;
    * ``group_of`` ``[M]``: the group of each sequence (index into the prefixes), for the KV cache;
    * ``suffix_ids`` ``[M, S]``: each sequence's tokens after its prefix, right-padded; ``mask``
      ``[M, P + S]``: its prefix's mask then its own; ``suffix_pos`` ``[M, S]``: the suffix's
      absolute positions (from ``mask``);
    * ``input_ids`` ``[M, P + S]``: prefix and suffix, the layout of ``cat([h_prefix[group_of], h_suffix], 1)``;
      ``ends``: index after each sequence's last token in that layout; ``n_cont``: its continuation tokens;
    * ``same``: pair index -> the pair indices (itself and its repeats) its score answers.
    """

    def __init__(self, **kw):
        self.__dict__.update(kw)


def prefix_chunk(pairs: Sequence[tuple[Sequence[int], int]], groups: Sequence[tuple[int, Sequence[int]]],
                 pad_id: int, device) -> PrefixChunk:
    """:class:`PrefixChunk` of ``groups`` (one ``("prefix", groups)`` entry of :func:`score_plan`)."""
    prefixes = [pairs[m[0]][0][:P] for P, m in groups]
    p_ids, p_mask = left_pad(prefixes, pad_id)
    group_of = [g for g, (_, m) in enumerate(groups) for _ in m]
    suffixes = [list(pairs[i][0][P:]) for P, m in groups for i in m]
    S = max(len(x) for x in suffixes)
    s_ids = torch.tensor([x + [pad_id] * (S - len(x)) for x in suffixes], dtype=torch.long)
    s_mask = torch.tensor([[1] * len(x) + [0] * (S - len(x)) for x in suffixes], dtype=torch.long)
    gi = torch.tensor(group_of, dtype=torch.long)
    mask = torch.cat([p_mask[gi], s_mask], 1)
    Pm = p_ids.shape[1]
    same: dict[int, list[int]] = {}
    first = {tuple(pairs[i][0]): i for _, m in groups for i in m}
    for j, (ids, _) in enumerate(pairs):
        if tuple(ids) in first:
            same.setdefault(first[tuple(ids)], []).append(j)
    dev = lambda t: t.to(device)  # noqa: E731
    return PrefixChunk(prefix_ids=dev(p_ids), prefix_mask=dev(p_mask), prefix_pos=dev(positions_from_mask(p_mask)),
                       group_of=dev(gi), suffix_ids=dev(s_ids), mask=dev(mask),
                       suffix_pos=dev(positions_from_mask(mask)[:, Pm:]),
                       input_ids=dev(torch.cat([p_ids[gi], s_ids], 1)), ends=[Pm + len(x) for x in suffixes],
                       n_cont=[pairs[i][1] for _, m in groups for i in m], same=same)


def score_order(pairs: Sequence[tuple[Sequence[int], int]], by_length: bool) -> list[int]:
    """The order in which ``score`` chunks ``pairs`` (``(token ids, n)`` of :func:`score_pairs`):
    as given, or ``by_length``: longest first, ties in the given order (stable), so a chunk's
    sequences have similar lengths and left padding wastes little compute. A row's pairs and a one
    pass's distinct pairs (the same pairs, first requested in the same order) get the same chunks."""
    idx = list(range(len(pairs)))
    return sorted(idx, key=lambda i: -len(pairs[i][0])) if by_length else idx


SCORE_BLOCK_POSITIONS = 1024
"""Most positions whose logits :func:`continuation_scores` holds at once: ``lm_head`` and the fp32
log-softmax materialise ``[positions, vocab]`` (SmolLM2: 1,024 x 49,152 x 4 bytes = 192 MiB a tensor)."""


def position_blocks(n: int, block: int | None = None) -> list[tuple[int, int]]:
    """``(start, end)`` of ``ceil(n / block)`` nearly equal blocks covering ``range(n)``; one block
    when ``n <= block`` (default :data:`SCORE_BLOCK_POSITIONS`, read at call time), so every block
    holds at least ``block // 2`` positions once ``n`` is split.
    (CPU BLAS picks another kernel for a matmul of very few rows, whose sums round differently; blocks
    this large give each row the bits of the one-matmul result, which
    ``tests/test_evaluate_score_blocks.py`` checks.)

    Raises:
        ValueError: ``block < 1``.
    """
    block = SCORE_BLOCK_POSITIONS if block is None else block
    if block < 1:
        raise ValueError(f"block must be >= 1 position, got {block}")
    k = max(1, -(-n // block))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k) if bounds[i + 1] > bounds[i]]


def continuation_scores(h: torch.Tensor, input_ids: torch.Tensor, n_cont: Sequence[int], lm_head,
                        softcap: float | None = None, ends: Sequence[int] | None = None,
                        block: int | None = None) -> list[ScoreContinuation]:
    """Scores of one chunk from its final hidden states.

    Args:
        h: ``[batch, seq, d_model]`` final hidden states (after the final norm and any head).
        input_ids: ``[batch, seq]`` int64; row ``i``'s tokens end at ``ends[i]`` (default ``seq``:
            left-padded) with its ``n_cont[i]`` continuation tokens.
        n_cont: continuation tokens per row.
        lm_head: the output projection (``d_model -> vocab``), applied only at the positions
            ``end - n - 1 .. end - 2`` of each row (those that predict its continuation).
        softcap: Gemma-2-style ``final_logit_softcapping`` (None: none), as the model's forward.
        ends: per row, the index after its last token (right-padded rows, :func:`prefix_chunk`).
        block: most positions scored at once (:func:`position_blocks`; None: :data:`SCORE_BLOCK_POSITIONS`):
            memory for logits and
            log-probabilities is ``[block, vocab]`` float32, not ``[sum(n_cont), vocab]``.
    Returns:
        One :class:`ScoreContinuation` per row: NLL in nats (float32 log-softmax), ``greedy`` when
        every continuation token is the argmax.
    """
    return head_continuation_scores(h, input_ids, n_cont, lm_head, [None], softcap=softcap, ends=ends, block=block)[0]


def factored_head_logits(model, head) -> bool:
    """Whether :func:`head_continuation_scores` takes ``head``'s logits in factored form on ``model``
    (:class:`~darts_bench.surgery.diagnostics.HeadLogits`: the plain merge's logits, once per block for
    every head, minus a ``[positions, rank] x [rank, vocab]`` product, plus the position bias's rows):
    a plain :class:`~darts_bench.surgery.heads.CorrectionHead` of rank below ``d_model / 4`` in float32
    (``HeadLogits.pays``) on a model whose ``lm_head`` is a bias-free float32 ``nn.Linear``. Its
    scores then differ from the head-then-``lm_head`` product's at float32 rounding level (the test model:
    within 1e-6 relative, greedy flags equal; SmolLM2-135M, 7 heads x 16 GSM8K reference answers: 109 of 112
    NLLs within 1e-6 relative, at most 1.24e-6, greedy flags 112/112 equal,
    ``results/bench-2026-12-05/eval_heads_factored_smollm2.log`` at 41a2363), and equal bitwise between the row-by-row ``HFTextModel.score`` and the one-pass
    ``HFMultiHeadModel.score``, which both score it this way."""
    lm_head = model.get_output_embeddings()
    return (head is not None and not getattr(head, "per_sequence", False)
            and HeadLogits.pays(head, model.config.hidden_size) and isinstance(lm_head, torch.nn.Linear)
            and lm_head.bias is None and lm_head.weight.dtype == torch.float32)


def head_continuation_scores(h: torch.Tensor, input_ids: torch.Tensor, n_cont: Sequence[int], lm_head,
                             heads: Sequence[object | None], positions: torch.Tensor | None = None,
                             softcap: float | None = None, ends: Sequence[int] | None = None,
                             block: int | None = None) -> list[list[ScoreContinuation]]:
    """Scores of one chunk under several heads from its plain final hidden states: ``lm_head`` runs
    once per block of continuation positions, and each head's logits come from those (factored;
    :class:`~darts_bench.surgery.diagnostics.HeadLogits`: ``W (h - U relu(D h) + b[p]) =
    W h - (W U) relu(D h) + (W b)[p]``), so a head costs a rank-``r`` product and its
    log-softmax, not a ``[positions, d_model] x [d_model, vocab]`` product of its own.

    Args:
        h: ``[batch, seq, d_model]`` final hidden states after the final norm, without any head
            (float32 when a head is given).
        input_ids, n_cont, lm_head, softcap, ends, block: as :func:`continuation_scores` (``lm_head``
            a bias-free ``nn.Linear`` when a head is given: :func:`factored_head_logits`).
        heads: per entry a :class:`~darts_bench.surgery.diagnostics.HeadLogits` (one per head and
            call, so its position-bias rows are computed once for all chunks) or None (the plain
            merge: the values of :func:`continuation_scores` on ``h``, bitwise).
        positions: ``[batch, seq]`` int64, the positions the heads' position biases read (those the
            head's hook reads in a forward: the chunk's ``position_ids``); needed when a head is given.
    Returns:
        Per entry of ``heads``, one :class:`ScoreContinuation` per row.

    Raises:
        ValueError: a head without ``positions``.
    """
    if positions is None and any(hl is not None for hl in heads):
        raise ValueError("head_continuation_scores: a head's logits need the chunk's positions")
    ends = [input_ids.shape[1]] * len(n_cont) if ends is None else ends
    bi = torch.tensor([i for i, n in enumerate(n_cont) for _ in range(n)], device=h.device, dtype=torch.long)
    ti = torch.tensor([t for n, e in zip(n_cont, ends) for t in range(e - n - 1, e - 1)], device=h.device,
                      dtype=torch.long)
    sel = h[bi, ti]  # [n_sel, d_model]
    tgt = input_ids[bi, ti + 1]  # [n_sel]
    psel = positions[bi, ti] if positions is not None else None  # [n_sel]
    nll_parts: list[list[torch.Tensor]] = [[] for _ in heads]
    hit_parts: list[list[torch.Tensor]] = [[] for _ in heads]
    blocks = position_blocks(len(tgt), block)
    rows = max((e - s for s, e in blocks), default=0)
    buf = None  # one head's logits [largest block, vocab], reused by every head and block
    for s, e in blocks:
        plain = lm_head(sel[s:e])  # [e - s, vocab]
        for j, hl in enumerate(heads):
            if hl is None:
                logits = plain
            else:
                if buf is None:
                    buf = plain.new_empty(rows, plain.shape[1])
                logits = hl.logits(plain, sel[s:e], psel[s:e], out=buf[:e - s])
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            logp = torch.log_softmax(logits.float(), dim=-1)
            del logits
            nll_parts[j].append(-logp.gather(-1, tgt[s:e, None])[:, 0])
            hit_parts[j].append(first_argmax(logp) == tgt[s:e])
            del logp
        del plain
    results = []
    for j in range(len(heads)):
        tok_nll = torch.cat(nll_parts[j]) if nll_parts[j] else torch.zeros(0, device=h.device)
        hit = torch.cat(hit_parts[j]) if hit_parts[j] else torch.zeros(0, dtype=torch.bool, device=h.device)
        out, o = [], 0
        for n in n_cont:
            out.append(ScoreContinuation(nll=float(tok_nll[o:o + n].sum()), n_tokens=n,
                                         greedy=bool(hit[o:o + n].all()), token_nll=tok_nll[o:o + n].tolist()))
            o += n
        results.append(out)
    return results


def _scores_from_logits(logits: torch.Tensor, input_ids: torch.Tensor,
                        n_cont: Sequence[int]) -> list[ScoreContinuation]:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [batch, seq, vocab]
    L, out = input_ids.shape[1], []
    for i, n in enumerate(n_cont):
        tgt = input_ids[i, L - n:]  # [n]
        lp = logp[i, L - n - 1:L - 1]  # predictions for the continuation tokens
        tok_nll = -lp.gather(-1, tgt[:, None])[:, 0]
        out.append(ScoreContinuation(nll=float(tok_nll.sum()), n_tokens=n, greedy=bool((first_argmax(lp) == tgt).all()),
                                     token_nll=tok_nll.tolist()))
    return out
