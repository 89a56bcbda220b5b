"""The correction head inside vLLM's model, for any decoder architecture vLLM has (imported by
vLLM's processes, needs ``vllm``).

For a checkpoint whose ``config.architectures[0]`` is ``<Arch>`` (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``MistralForCausalLM``, ``Gemma2ForCausalLM``, ...), ``Darts<Arch>`` is
built on first use as a subclass of vLLM's own class for ``<Arch>`` (:func:`darts_model_class`;
this module's ``__getattr__`` builds it, so ``"darts_bench.evaluate.engines.vllm_model:Darts<Arch>"``
is a lazy registry entry like vLLM's own: :mod:`~darts_bench.evaluate.engines.vllm_plugin`).
Its ``forward`` applies a :class:`~darts_bench.surgery.heads.CorrectionHead` to the final hidden
states that vLLM's ``forward`` returns: the output of the last norm, the tensor whose rows
``compute_logits`` then receives (the input of ``lm_head``, before any logit soft-capping), as
the HF path's hook on ``model.model.norm`` does. The head's positions are vLLM's per-token
``positions``: each token's absolute position in its own request, also under chunked prefill and
prefix caching, i.e. what ``positions_from_mask`` gives on the HF path. Logits, sampling and
``prompt_logprobs`` then see the corrected states. (The head is applied in ``forward`` rather than
in ``compute_logits`` because ``compute_logits`` receives only the sampled rows, without their
positions.)

The head directory comes from ``hf_overrides={"architectures": ["Darts<Arch>"],
"darts_head_dir": DIR}`` (empty: no head, the plain model), and can be swapped in a running
engine by :class:`DartsWorkerExtension` (``LLM.collective_rpc("darts_set_head", args=(DIR,))``):
the KV cache does not depend on the head (it only acts after the last layer), so cached prefixes
stay valid across heads.

Per-request heads (one ``generate`` batching the rows of a merge): :meth:`DartsHeadMixin.set_darts_heads`
loads a list of heads beside the swapped one (``collective_rpc("darts_set_heads", args=(DIRS,))``)
and a request names its head by ``SamplingParams(extra_args={"darts_head": i})`` (``-1``: no head;
no key: the swapped head). :class:`DartsHeadRouter`, a logits processor that leaves logits
unchanged, keeps each persistent-batch row's head from vLLM's ``BatchUpdate`` records (called before
every forward pass); ``forward`` expands the rows to tokens with the attention metadata's
``query_start_loc`` and applies each head to its own tokens' hidden states.

vLLM API relied on: ``ModelRegistry.models[arch].load_model_cls()`` (the registry entry of
``arch``, public attribute and method since vLLM 0.6) and the model-class contract
``__init__(*, vllm_config, prefix)`` / ``forward(input_ids, positions, ...) -> hidden states``;
for per-request heads also the public logits-processor interface
(``vllm.v1.sample.logits_processor.LogitsProcessor``: ``update_state(BatchUpdate)`` before each
forward, rows added / removed / moved), ``vllm.forward_context.get_forward_context().attn_metadata``
(per layer, with ``query_start_loc [num_reqs + 1]``), and one invariant of vLLM's v1 model runner
that no public API states: the flattened tokens of a step are laid out request by request in
persistent-batch row order (``GPUModelRunner._prepare_inputs``: ``req_indices = repeat(arange(num_reqs),
num_scheduled_tokens)``), which the CPU runner inherits. The parity tests check it.
"""

from __future__ import annotations

import torch

from darts_bench.evaluate.engines.vllm_plugin import PREFIX, darts_arch
from darts_bench.surgery.heads import CorrectionHead, load_head


class DartsHeadMixin:
    """The head slot mixed before vLLM's model class in ``Darts<Arch>``.

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

    def _darts_hidden_size(self) -> int:
        cfg = self.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return int(text.hidden_size)

    def set_darts_head(self, head_dir: str | None) -> str:
        """Load the head saved in ``head_dir`` (``save_head``'s files); ``None``/``""``: no head.

        Raises:
            ValueError: the head's ``d_model`` differs from the model's hidden size.
        """
        if not head_dir:
            self.darts_head, self.darts_head_dir = None, ""
            return ""
        head = load_head(head_dir)
        d = self._darts_hidden_size()
        if head.cfg.d_model != d:
            raise ValueError(f"head {head_dir}: d_model {head.cfg.d_model} != model hidden_size {d}")
        dev = next(self.parameters()).device
        self.darts_head, self.darts_head_dir = head.to(dev).eval(), str(head_dir)
        return self.darts_head_dir

    def forward(self, input_ids, positions, *args, **kwargs):
        h = super().forward(input_ids, positions, *args, **kwargs)
        if not isinstance(h, torch.Tensor):  # not the last pipeline-parallel rank
            return h
        tok_heads = self._token_heads(h.shape[0])
        if tok_heads is not None:
            return self._apply_heads(h, positions.to(h.device).long(), tok_heads)
        if self.darts_head is None:
            return h
        return self.darts_head(h, positions.to(h.device).long())


    # ------------------------------------------------------------------ per-request heads
    def set_darts_heads(self, head_dirs: list[str | None]) -> int:
        """Load the heads a request can name by index (``extra_args["darts_head"]``); ``None``
        entries are the plain model. Returns the number loaded.

        Raises:
            ValueError: a head's ``d_model`` differs from the model's hidden size.
        """
        heads: list[CorrectionHead | None] = []
        d, dev = self._darts_hidden_size(), next(self.parameters()).device
        for hd in head_dirs:
            if not hd:
                heads.append(None)
                continue
            head = load_head(hd)
            if head.cfg.d_model != d:
                raise ValueError(f"head {hd}: d_model {head.cfg.d_model} != model hidden_size {d}")
            heads.append(head.to(dev).eval())
        self.darts_heads = heads
        return len(heads)

    def _token_heads(self, num_tokens: int) -> torch.Tensor | None:
        """Head index per token ``[num_tokens]`` int64 (``-2``: the swapped head, ``-1``: none), or
        None when no request of this step names a head (then the swapped head applies to all)."""
        router = DartsHeadRouter.current
        if router is None or not router.rows:
            return None
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        md = get_forward_context().attn_metadata
        if not md:  # a dummy / profiling run
            return None
        if isinstance(md, list):
            raise RuntimeError("per-request heads: micro-batched forward passes (DBO) are not supported")
        qsl = next(iter(md.values())).query_start_loc.to("cpu", torch.int64)  # [num_reqs + 1]
        n_req = qsl.numel() - 1
        row_head = torch.tensor([router.rows.get(r, -2) for r in range(n_req)], dtype=torch.int64)
        tok = torch.repeat_interleave(row_head, qsl.diff())
        if tok.numel() > num_tokens:
            raise RuntimeError(f"per-request heads: {tok.numel()} scheduled tokens > {num_tokens} in the forward")
        return torch.cat([tok, torch.full((num_tokens - tok.numel(),), -1, dtype=torch.int64)])  # padding: none

    def _apply_heads(self, h: torch.Tensor, positions: torch.Tensor, tok_heads: torch.Tensor) -> torch.Tensor:
        out = h
        heads = getattr(self, "darts_heads", [])
        for k in tok_heads.unique().tolist():
            if k >= len(heads):
                raise ValueError(f"a request names head {k}; the engine holds {len(heads)} (darts_set_heads)")
            head = self.darts_head if k == -2 else None if k == -1 else heads[k]
            if head is None:
                continue
            sel = (tok_heads == k).nonzero().squeeze(1).to(h.device)
            if out is h:
                out = h.clone()
            out[sel] = head(h[sel], positions[sel])
        return out


_CLASSES: dict[str, type] = {}


def darts_model_class(arch: str) -> type:
    """``Darts<arch>``: vLLM's model class registered for ``arch`` with :class:`DartsHeadMixin`
    (built once per process).

    Raises:
        ValueError: vLLM has no model class for ``arch`` (names the architectures it has).
    """
    if arch in _CLASSES:
        return _CLASSES[arch]
    import vllm
    from vllm import ModelRegistry

    if arch.startswith(PREFIX) or arch not in ModelRegistry.get_supported_archs():
        have = sorted(a for a in ModelRegistry.get_supported_archs() if a.endswith("ForCausalLM")
                      and not a.startswith(PREFIX))
        raise ValueError(f"vLLM {vllm.__version__} has no model class for architecture {arch!r}; "
                         f"its causal LMs are {have}")
    base = ModelRegistry.models[arch].load_model_cls()
    name = darts_arch(arch)
    cls = type(name, (DartsHeadMixin, base), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"vLLM ``{base.__module__}.{base.__qualname__}`` (``{arch}``) + an optional correction "
                   "head on its final hidden states (:class:`DartsHeadMixin`)."})
    _CLASSES[arch] = cls
    return cls


def __getattr__(name: str):
    """``Darts<Arch>`` on first access (the lazy registry entry's ``getattr(module, class_name)``)."""
    if name.startswith(PREFIX) and len(name) > len(PREFIX):
        try:
            return darts_model_class(name[len(PREFIX):])
        except ValueError as e:
            raise AttributeError(str(e)) from None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _router_base():
    from vllm.v1.sample.logits_processor import LogitsProcessor

    return LogitsProcessor


class DartsHeadRouter(_router_base()):
    """A logits processor that changes no logits: it keeps, per persistent-batch row, the head its
    request names (``SamplingParams.extra_args["darts_head"]``: an index into the heads of
    ``darts_set_heads``, ``-1`` none), for the model's forward. The latest instance of the process
    (the model runner's current input batch) is :attr:`current`."""

    current: "DartsHeadRouter | None" = None

    def __init__(self, vllm_config, device, is_pin_memory: bool):
        self.rows: dict[int, int] = {}
        DartsHeadRouter.current = self

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        h = (sampling_params.extra_args or {}).get("darts_head")
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < -1):
            raise ValueError(f"extra_args['darts_head'] must be a head index >= -1, got {h!r}")

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        from vllm.v1.sample.logits_processor import MoveDirectionality

        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, _, _ in batch_update.added:
            h = (getattr(params, "extra_args", None) or {}).get("darts_head")
            if h is None:
                self.rows.pop(i, None)
            else:
                self.rows[i] = int(h)
        for a, b, direction in batch_update.moved:
            ha, hb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ha is not None:
                self.rows[b] = ha
            if direction == MoveDirectionality.SWAP and hb is not None:
                self.rows[a] = hb


ROUTER = f"{__name__}:DartsHeadRouter"


def reprocess_tied_weights(model: torch.nn.Module) -> int:
    """Process again the layers that share a weight tensor with another layer (a tied output embedding:
    ``lm_head`` on ``embed_tokens``' weight); returns how many were.

    vLLM's in-place reload (the worker's ``reload_weights``) loads each checkpoint tensor into the layer
    that owns it and runs that layer's ``quant_method.process_weights_after_loading``; a tied
    ``lm_head`` loads nothing of its own, so it keeps its processed form of the old weights. On the
    CPU that form is a packed oneDNN copy of the weight made at start (``dispatch_cpu_unquantized_gemm``),
    so without this the logits would still come from the old checkpoint's embedding (seen: SmolLM2-135M's
    experts after the base, 0.1-2 nats off a new engine's log-probabilities).

    Raises:
        TypeError: a tied layer is quantized (processing it twice is not known to be safe).
    """
    groups: dict[tuple, list[torch.nn.Module]] = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor) and w.numel() and getattr(mod, "quant_method", None) is not None:
            groups.setdefault((w.data_ptr(), tuple(w.shape)), []).append(mod)
    n = 0
    for mods in groups.values():
        if len(mods) < 2:
            continue
        for mod in mods:
            qm = mod.quant_method
            if not type(qm).__name__.startswith("Unquantized"):
                raise TypeError(f"{type(mod).__name__} shares its weight and is quantized ({type(qm).__name__}): "
                                "weights cannot be reloaded in place (set evaluate.vllm.reload_weights=false)")
            qm.process_weights_after_loading(mod)
            n += 1
    return n


class DartsWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): RPCs that swap the head in place, load the
    per-request heads and load another checkpoint's weights in place."""

    def darts_reload_weights(self, weights_path: str) -> int:
        """The worker's ``reload_weights(weights_path=...)`` (vLLM's in-place reload, which points the
        worker's model config at ``weights_path``), then :func:`reprocess_tied_weights`; returns the
        number of tied layers processed again."""
        from vllm.config import set_current_vllm_config

        self.reload_weights(weights_path=weights_path)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            return reprocess_tied_weights(self.model_runner.get_model())

    def darts_set_heads(self, head_dirs: list[str | None]) -> int:
        model = self.model_runner.get_model()
        if not hasattr(model, "set_darts_heads"):
            raise TypeError(f"the engine's model is {type(model).__name__}, not a Darts<Arch> model class")
        return model.set_darts_heads(head_dirs)

    def darts_set_head(self, head_dir: str | None) -> str:
        model = self.model_runner.get_model()
        if not hasattr(model, "set_darts_head"):
            raise TypeError(f"the engine's model is {type(model).__name__}, not a Darts<Arch> model class")
        return model.set_darts_head(head_dir)
