"""The HF backend (``hf``, the default and the reference): transformers models behind
:class:`~darts_bench.evaluate.hf_model.HFTextModel`, the correction head attached by a hook.

Layouts (chosen by ``executor.in_process``):

* in-process (``executor: local``): the backend loads each checkpoint itself
  (:func:`load_text_model`) and hands out light wrappers that share its weights, each with the
  task's head attached until the wrapper is closed. Rows of one model dir (a merge and its
  corrected rows) differ only in their heads and the AlpacaEval judge is the same model for every
  row, so a checkpoint is loaded once: at most the current model dir and the pinned ones (the
  judge) stay loaded. A head hook acts on every forward of the shared weights, so while a wrapper
  with a head is open no other wrapper shares them (such a request gets its own copy, counted as
  a load).
* Ray (``executor: ray``): proxies on actor groups of
  :class:`~darts_bench.executors.worker.ModelWorker` (``RayExecutor.text_model``), one group per
  model dir held open by :class:`~darts_bench.evaluate.engines.base.HeldProxies`; each request's
  head travels with its calls and the actors swap it on the loaded model
  (:meth:`ModelWorker.set_head <darts_bench.executors.worker.ModelWorker.set_head>`).

Calibration continuations go through ``executor.map(model_dir, "generate_ids", ...)`` in shards
of ``ray.shard_size`` prompts (the in-process worker or the Ray actors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Iterable

import torch

from darts_bench.evaluate.engines.base import Backend
from darts_bench.evaluate.hf_model import HFTextModel, load_causal_lm
from darts_bench.evaluate.prefix_cache import PREFIX_BLOCK_TOKENS, PrefixBlockCache
from darts_bench.surgery.heads import load_head


def load_text_model(model_dir: str | Path, name: str = "model", head_dir: str | Path | None = None, *,
                    device: str = "cpu", dtype: str = "float32", batch_size: int = 8,
                    torch_threads: int | None = None, share_prefix: bool = False,
                    prefix_cache_mib: int = 0) -> HFTextModel:
    """Load ``model_dir`` (HF checkpoint dir) as an :class:`HFTextModel` named ``name``, with the head
    saved in ``head_dir`` attached (None: the plain model).

    Args:
        device: torch device of the weights (``cpu``, ``cuda``, ``cuda:1``).
        dtype: ``float32`` | ``bfloat16`` | ``float16`` (the weights' and hidden states' dtype).
        batch_size: prompts per forward / ``generate`` call.
        torch_threads: ``torch.set_num_threads`` first (None: unchanged).
        share_prefix: ``HFTextModel``'s ``share_prefix`` (``evaluate.share_prefix``): a context shared by
            several distinct pairs of a score call is forwarded once.
        prefix_cache_mib: with ``share_prefix``, a :class:`~darts_bench.evaluate.prefix_cache.PrefixBlockCache`
            of this many MiB for the plain model's shared contexts across calls (``evaluate.prefix_cache_mib``;
            0: none).
    Raises:
        FileNotFoundError / ValueError: the checkpoint dir is missing, incomplete or corrupt
            (:func:`~darts_bench.evaluate.hf_model.check_checkpoint`), or the head's files are
            missing or its ``d_model`` differs from the model's hidden size.
    """
    if torch_threads:
        torch.set_num_threads(torch_threads)
    model, tok = load_causal_lm(model_dir, dtype=getattr(torch, dtype), device=device)
    return HFTextModel(name, model, tok, head=load_head(head_dir) if head_dir else None, batch_size=batch_size,
                       share_prefix=share_prefix,
                       prefix_cache=PrefixBlockCache.from_mib(prefix_cache_mib) if share_prefix else None)


class HFBackend(Backend):
    """The ``hf`` backend for one run (see the module docstring for its layouts).

    Args:
        cfg, executor, batch_size, role: as :class:`~darts_bench.evaluate.engines.base.Backend`; models
            are loaded on ``cfg.device`` in ``cfg.pool.dtype`` with ``cfg.torch_threads``, scoring with
            ``cfg.evaluate.share_prefix`` (in process; the executor's workers read it from the config too).

    Attributes:
        share_weights: in-process: wrappers of one model dir share its loaded weights (False: every
            request loads its own copy, the reference the cache is tested against).
    """

    name = "hf"
    share_weights: ClassVar[bool] = True

    def __init__(self, cfg, executor, batch_size: int | None = None, role: str = "evaluate",
                 merge_dirs: Iterable[str | Path] = ()):
        super().__init__(cfg, executor, batch_size, role, merge_dirs)
        self._base: dict[str, HFTextModel] = {}
        self._pinned: set[str] = set()
        self._open: dict[str, list[_Shared]] = {}

    @classmethod
    def cache_key(cls, cfg, role: str = "evaluate") -> dict[str, Any]:
        """Empty by default: HF artifact keys carry no backend part (they predate the backends). With
        ``evaluate.share_prefix`` the evaluate role's key says so (its scores differ at rounding level), and
        with ``evaluate.prefix_cache_mib`` too the block size (:mod:`darts_bench.evaluate.prefix_cache`: values
        depend on it, not on the budget)."""
        if role != "evaluate" or not cfg.evaluate.share_prefix:
            return {}
        return {"share_prefix": True, **({"prefix_blocks": PREFIX_BLOCK_TOKENS} if cfg.evaluate.prefix_cache_mib else {})}

    def _load(self, name: str, model_dir: str, head_dir: str | None) -> HFTextModel:
        self._loads += 1
        c = self.cfg
        return load_text_model(model_dir, name, head_dir, device=c.device, dtype=c.pool.dtype,
                               batch_size=self.batch_size, torch_threads=c.torch_threads,
                               share_prefix=c.evaluate.share_prefix, prefix_cache_mib=c.evaluate.prefix_cache_mib)

    def _open_proxy(self, name: str, model_dir: str, head_dir: str | None):
        return self.executor.text_model(name, model_dir, head_dir, batch_size=self.batch_size)

    def get(self, name: str, model_dir: str | Path, head_dir: str | Path | None = None, pin: bool = False):
        """See :meth:`Backend.get`: a wrapper over the shared weights (in-process) or a proxy on
        the model dir's actor group (Ray)."""
        self._check_open()
        key, head = str(model_dir), str(head_dir) if head_dir else None
        if not self.executor.in_process:
            return self._get_remote(name, key, head, pin)
        if not self.share_weights:
            return self._load(name, key, head)
        if pin:
            self._pinned.add(key)
        if key not in self._base:
            for k in [k for k in self._base if k not in self._pinned and not pin]:
                del self._base[k]
            self._base[key] = self._load(name, key, None)
        base = self._base[key]
        live = self._open.setdefault(key, [])
        live[:] = [w for w in live if not w.closed]
        if live and (head or any(w.head is not None for w in live)):
            return self._load(name, key, head)  # a head would act on the other wrapper's forwards: a private copy
        w = _Shared(name, base.model, base.tokenizer, head=load_head(head) if head else None,
                    batch_size=self.batch_size, max_length=base.max_length, share_prefix=base.share_prefix,
                    prefix_cache=base.prefix_cache)
        live.append(w)
        return w

    def multi_head_model(self, name: str, model_dir: str | Path, head_dirs: list[str | Path | None]):
        """See :meth:`Backend.multi_head_model`. In-process: an
        :class:`~darts_bench.evaluate.multi_head.HFMultiHeadModel` over the shared weights of
        ``model_dir`` (loaded once, as :meth:`get` loads it) with every slot's head, each chosen per
        sequence of one batched forward; its hooks exist only during its calls, so it shares the
        weights with the plain wrappers :meth:`get` hands out. Ray: the base class's multi-head
        proxy (each actor's ``HFMultiHeadModel``).

        Raises:
            FileNotFoundError / ValueError: a missing or corrupt checkpoint or head.
        """
        self._check_open()
        if not self.executor.in_process:
            return super().multi_head_model(name, model_dir, head_dirs)
        from darts_bench.evaluate.multi_head import HFMultiHeadModel

        key = str(model_dir)
        if not self.share_weights:
            base = self._load(name, key, None)
        else:
            if key not in self._base:
                for k in [k for k in self._base if k not in self._pinned]:
                    del self._base[k]
                self._base[key] = self._load(name, key, None)
            base = self._base[key]
        return HFMultiHeadModel.from_head_dirs(base, head_dirs, name=name,
                                               max_batch=self.cfg.evaluate.one_pass_max_batch)

    def continuations(self, name: str, model_dir: str | Path, prompt_ids: list[list[int]], max_new_tokens: int,
                      desc: str = "") -> list[list[int]]:
        """See :meth:`Backend.continuations`: ``generate_ids`` shards of ``ray.shard_size`` prompts
        on the executor (the worker it keeps for ``model_dir``, or its actors)."""
        self._check_open()
        shard = self.cfg.ray.shard_size
        payloads = [{"prompts": prompt_ids[i:i + shard], "kwargs": {"max_new_tokens": max_new_tokens}}
                    for i in range(0, len(prompt_ids), shard)]
        gens = self.executor.map(str(model_dir), "generate_ids", payloads, desc=desc or f"generate {name}")
        return [s[0] for part in gens for s in part]

    def close(self) -> None:
        """Drop every loaded model and close the held proxies (their actors are released); log what each
        model's prefix cache (``evaluate.prefix_cache_mib``) saved."""
        for key, base in self._base.items():
            if base.prefix_cache is not None:
                base.prefix_cache.log_use(key)
        super().close()
        self._base.clear()
        self._pinned.clear()
        self._open.clear()


class _Shared(HFTextModel):
    """A wrapper over weights owned by an :class:`HFBackend`; ``closed`` after :meth:`close`."""

    closed = False

    def close(self) -> None:
        super().close()
        self.closed = True
