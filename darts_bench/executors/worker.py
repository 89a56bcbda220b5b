"""The HF worker: one model (optionally with a correction head) serving shard operations, in
process (:class:`~darts_bench.executors.local.LocalExecutor`) or as the body of a Ray actor. The
vLLM engine worker is :class:`~darts_bench.executors.vllm_worker.VLLMWorker`; both serve the
text-model ops through :func:`run_text_op`."""

from __future__ import annotations

from typing import Any

import torch

from darts_bench.collect.store import encode_features
from darts_bench.evaluate.engines.hf import load_text_model
from darts_bench.evaluate.hf_model import HFTextModel, left_pad
from darts_bench.surgery.heads import load_head, positions_from_mask
from darts_bench.surgery.losses import lm_head_entropy


@torch.inference_mode()
def hidden_state_features(model, sequences: list[list[int]], pad_id: int, batch_size: int = 8,
                          entropy: bool = True) -> dict[str, torch.Tensor]:
    """Final hidden states (after the last norm, input of ``lm_head``) and next-token entropy for
    every real token of every sequence.

    Args:
        sequences: token id lists (prompt + continuation), processed left-padded in batches with
            ``position_ids`` from the attention mask, so a sequence's features do not depend on what
            it is batched with (bitwise in bfloat16 too).
        entropy: compute the next-token entropy (``lm_head`` and a softmax over the vocabulary per
            token: ~22% of the work on SmolLM2-135M, whose vocabulary is a fifth of its weights);
            False: no ``entropy`` column (a merged model's, read only by ``surgery.entropy_source:
            merged``).
    Returns:
        ``h`` ``[N, d_model]`` in the model's dtype (float32 on the tiny tier, bf16 at scale), ``entropy`` ``[N]`` float32 (nats), ``positions`` ``[N]`` int64
        (absolute, from 0), ``seq_index`` ``[N]`` int64 (index into ``sequences``); N = total tokens,
        sequences in order, tokens in order.
    """
    hs, ents, poss, sids = [], [], [], []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        ids, mask = left_pad(chunk, pad_id)
        L = ids.shape[1]
        dev = next(model.parameters()).device
        # positions from the mask: each row's rotary positions start at 0 at its first real token,
        # whatever its left padding (plain forward does not derive them; generate does)
        out = model.model(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                          position_ids=positions_from_mask(mask).to(dev))
        h = out.last_hidden_state  # [batch, seq, d_model], after the final norm
        real = torch.cat([h[i, L - len(s):] for i, s in enumerate(chunk)])  # [tokens, d_model], no padding
        if entropy:
            ents.append(lm_head_entropy(model.lm_head, real).cpu())
        hs.append(real.cpu())
        for i, s in enumerate(chunk):
            n = len(s)
            poss.append(torch.arange(n, dtype=torch.long))
            sids.append(torch.full((n,), start + i, dtype=torch.long))
    out = {"h": torch.cat(hs), "entropy": torch.cat(ents) if entropy else None, "positions": torch.cat(poss),
           "seq_index": torch.cat(sids)}
    return {k: v for k, v in out.items() if v is not None}



TEXT_OPS = ("generate_ids", "generate", "score")
#: the multi-head ops (the evaluate stage's one pass over a merge's rows in the Ray layout): payload
#: ``head_dirs`` (one entry per slot, None: plain), ``requests`` (``(slot, prompt)`` for the generate
#: ops, ``(slot, context, continuation)`` for ``multi_score``) and, for generation, ``kwargs``
MULTI_OPS = ("multi_generate_ids", "multi_generate", "multi_score")


def run_text_op(tm, op: str, payload: dict[str, Any]) -> Any:
    """One :class:`~darts_bench.api.TextModel` call of a worker payload: ``generate_ids`` /
    ``generate`` (``prompts``, ``kwargs``) or ``score`` (``contexts``, ``continuations``); shared by
    the HF :class:`ModelWorker` and the vLLM engine worker
    (:class:`~darts_bench.executors.vllm_worker.VLLMWorker`).

    Raises:
        ValueError: ``op`` is not one of :data:`TEXT_OPS`.
    """
    if op == "generate_ids":
        return tm.generate_ids(payload["prompts"], **payload["kwargs"])
    if op == "generate":
        return tm.generate(payload["prompts"], **payload["kwargs"])
    if op == "score":
        return tm.score(payload["contexts"], payload["continuations"])
    raise ValueError(f"unknown text-model op {op!r} (ops: {TEXT_OPS})")


def run_multi_op(mh, op: str, payload: dict[str, Any]) -> Any:
    """One call of a worker's multi-head model (``HFMultiHeadModel`` or ``VLLMMultiHeadModel``) for a
    :data:`MULTI_OPS` payload; results one per request, in request order.

    Raises:
        ValueError: ``op`` is not one of :data:`MULTI_OPS`; a slot out of range (from the model).
    """
    reqs = [tuple(r) for r in payload["requests"]]
    if op == "multi_generate_ids":
        return mh.generate_ids(reqs, **payload["kwargs"])
    if op == "multi_generate":
        return mh.generate(reqs, **payload["kwargs"])
    if op == "multi_score":
        return mh.score(reqs)
    raise ValueError(f"unknown multi-head op {op!r} (ops: {MULTI_OPS})")


class ModelWorker:
    """Holds one model (loaded in ``dtype``: ``float32`` | ``bfloat16`` | ``float16``); ``run(op, payload)``
    serves ``generate_ids``, ``generate``, ``score``, the multi-head ops (:data:`MULTI_OPS`: every
    head of a merge in one pass, :class:`~darts_bench.evaluate.multi_head.HFMultiHeadModel` over the
    loaded weights), ``prompt_states``, ``features``, ``set_head`` and ``ping``.

    The checkpoint is loaded once, in the constructor; the correction head on it can be swapped
    without reloading (:meth:`set_head`): every payload may carry ``head_dir`` (a head dir, or None
    for the plain model), which is put in place before the op runs, so one worker (one Ray actor)
    serves a merge and all its corrected rows, and a call's result depends only on its payload.

    Used in-process by the local executor and as the body of a Ray actor. The checkpoint is loaded
    by :func:`~darts_bench.evaluate.engines.hf.load_text_model` (the HF backend's loader); ``share_prefix``
    is its text models' (``evaluate.share_prefix``: a context shared by several pairs of a score call is
    forwarded once), ``prefix_cache_mib`` its plain model's block cache across calls (``evaluate.prefix_cache_mib``).

    Attributes:
        checkpoint_loads: checkpoints this worker loaded (1).
        head_loads: heads loaded from disk so far (one per swap to a head dir).
    """

    def __init__(self, model_dir: str, head_dir: str | None = None, name: str = "model",
                 device: str = "cpu", batch_size: int = 8, torch_threads: int | None = None,
                 dtype: str = "float32", share_prefix: bool = False, prefix_cache_mib: int = 0):
        self._plain = load_text_model(model_dir, name, None, device=device, dtype=dtype, batch_size=batch_size,
                                      torch_threads=torch_threads, share_prefix=share_prefix,
                                      prefix_cache_mib=prefix_cache_mib)
        self.checkpoint_loads, self.head_loads = 1, 0
        self.text_model, self.head_dir = self._plain, None
        self._multi: tuple[tuple, Any] | None = None  # (head dirs, HFMultiHeadModel) of the last multi-head op
        self.set_head(head_dir)

    def multi_head_model(self, head_dirs: list[str | None], max_batch: int | None = None):
        """The :class:`~darts_bench.evaluate.multi_head.HFMultiHeadModel` of the loaded weights with
        ``head_dirs``'s heads (one slot each; None: plain), kept for the next call with the same
        dirs (the heads are loaded once per merge's group of rows); its hooks exist only during its
        calls, so the single-head text model is unaffected. ``max_batch``: sequences per stacked
        ``generate`` (``evaluate.one_pass_max_batch``; None: no cap).

        Raises:
            FileNotFoundError / ValueError: a missing or corrupt head, or one whose ``d_model``
                differs from the model's hidden size.
        """
        from darts_bench.evaluate.multi_head import HFMultiHeadModel

        key = tuple(str(h) if h else None for h in head_dirs)
        if self._multi is None or self._multi[0] != key:
            self._multi = None
            loaded = {h: load_head(h) for h in dict.fromkeys(k for k in key if k)}
            self.head_loads += len(loaded)
            self._multi = (key, HFMultiHeadModel(self._plain, [loaded[h] if h else None for h in key],
                                                 name=self._plain.name, keys=list(key)))
        self._multi[1].max_batch = max_batch
        return self._multi[1]

    def set_head(self, head_dir: str | None) -> None:
        """Put the head saved in ``head_dir`` on the loaded model (None: the plain model): the
        previous head's hook is removed first; the same dir again is a no-op.

        Raises:
            FileNotFoundError / ValueError: from :func:`~darts_bench.surgery.heads.load_head` and
                ``attach_head`` (missing files, ``d_model`` != the model's hidden size); the worker
                is then left with the plain model.
        """
        want = str(head_dir) if head_dir else None
        if want == self.head_dir:
            return
        if self.text_model is not self._plain:
            self.text_model.close()  # detaches the old head's hook
        self.text_model, self.head_dir = self._plain, None
        if want is not None:
            p = self._plain
            self.text_model = HFTextModel(p.name, p.model, p.tokenizer, head=load_head(want),
                                          batch_size=p.batch_size, max_length=p.max_length,
                                          share_prefix=p.share_prefix)
            self.head_dir = want
            self.head_loads += 1

    def run(self, op: str, payload: dict[str, Any]) -> Any:
        if "head_dir" in payload:
            self.set_head(payload["head_dir"])
        tm = self.text_model
        if op in TEXT_OPS:
            return run_text_op(tm, op, payload)
        if op in MULTI_OPS:
            return run_multi_op(self.multi_head_model(payload["head_dirs"], payload.get("max_batch")), op, payload)
        if op == "prompt_states":  # the plain model's (the routed rows' router reads them)
            return self._plain.prompt_states(payload["prompts"])
        if op == "features":
            feats = hidden_state_features(tm.model, payload["sequences"], tm.tokenizer.pad_token_id, tm.batch_size,
                                          entropy=payload.get("entropy", True))
            return encode_features(feats)
        if op == "set_head":
            return self.head_dir
        if op == "ping":
            return "ok"
        raise ValueError(f"unknown worker op {op!r}")
