"""Any darts-bench :class:`~darts_bench.api.TextModel` as an lm-eval ``LM`` (registered as
``"darts-bench"``), so lm-eval tasks run on exactly what darts-bench evaluates — a merged model with
a correction head attached included.

Only lm-eval's public API is used (``lm_eval.api.model.LM``, ``lm_eval.api.registry.register_model``
and the hooks ``simple_evaluate`` calls: ``generate_until``, ``loglikelihood``,
``loglikelihood_rolling``, ``apply_chat_template``, ``tokenizer_name``, ``chat_template``).

Usage::

    lm = DartsBenchLM(text_model)                     # wrap an in-memory model (fast)
    lm_eval.simple_evaluate(model=lm, tasks=[...], device="cpu", ...)
    # or by name, any row of a run (`darts-bench export ROW --to DIR` gives both dirs):
    simple_evaluate(model="darts-bench", model_args="pretrained=DIR/model,head=DIR/heads/gsm8k", ...)

From lm-eval's own command line, with this model registered: ``darts-bench lm-eval run --model
darts-bench --model_args pretrained=...,head=... --tasks ...`` (every argument after ``lm-eval`` goes to
lm-eval's CLI). With an lm-eval that discovers plugins (its main branch: the ``lm_eval.models``
entry-point group, ``docs/plugins.md``), ``lm-eval run --model darts-bench`` finds the model by
itself: darts-bench declares ``darts-bench = "darts_bench.evaluate.lm_eval_adapter:DartsBenchLM"``
in that group (pyproject.toml), which lm-eval records as a lazy placeholder and imports on first use
(the ``@register_model`` below then upgrades the placeholder). lm-eval 0.4.x loads no plugins: there,
use ``darts-bench lm-eval``, which imports this module first.

Protocol choices (documented here because lm-eval leaves them to the backend):

* ``generate_until``: greedy only. Requests are grouped by ``(until, max_gen_toks)``; within a group
  they are sorted by prompt length (less padding) and passed to ``TextModel.generate`` in one call
  (the model batches), then put back in lm-eval's order; each request's finish reason (``stop`` /
  ``length``) is kept in ``finish_reasons`` by (task, doc id). ``until`` is the stop list; the output is
  also cut at the first stop sequence here, so a TextModel that ignores ``stop`` still conforms.
* ``loglikelihood``: ``TextModel.score`` gives summed NLL and greedy-ness; we return ``(-nll, greedy)``.
  Trailing whitespace of the context moves to the continuation (as lm-eval's ``TemplateLM``). An
  empty context is replaced by the model's prefix token text (BOS, else EOS) when its tokenizer
  does not add one itself, so the first continuation token is scored.
* ``loglikelihood_rolling``: the whole string is scored as one continuation of that same prefix
  (no rolling windows: the TextModel API takes text, not token windows). A string longer than the
  wrapped model's ``max_length`` raises instead of being silently truncated.
* Chat templates: when the wrapped model's tokenizer has a chat template, ``apply_chat_template``
  calls ``tokenizer.apply_chat_template`` exactly as lm-eval's HFLM does (retrying without the
  system turn if the template rejects it). Otherwise each user turn is rendered with the model's own
  ``format_chat`` (the template darts-bench uses everywhere else), system text is prepended to the
  first user turn, and assistant turns follow their prompt verbatim, separated by a blank line.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from darts_bench.api import TextModel
from darts_bench.evaluate.hf_model import cut_at_stop

log = logging.getLogger(__name__)

# Generation kwargs that do not change greedy decoding and are therefore accepted and ignored.
_IGNORED_UNDER_GREEDY = {"top_p", "top_k", "min_p", "typical_p"}


@register_model("darts-bench")
class DartsBenchLM(LM):
    """lm-eval ``LM`` over a darts-bench ``TextModel``.

    Args:
        model: the wrapped TextModel (e.g. ``HFTextModel`` with a correction head attached).
        pretrained: instead of ``model``, a checkpoint dir loaded as an ``HFTextModel`` (for
            ``simple_evaluate(model="darts-bench", model_args="pretrained=...")``).
        head: with ``pretrained``, a correction head dir (``head.safetensors`` + ``head_config.json``,
            as the train stage writes under ``heads/<merge>-<task>-<split>-<key>/<method>/``)
            attached to the model's final hidden states, as ``darts-bench run`` evaluates a
            ``+surgery`` / ``+darts`` row on that head's task.
        dtype: with ``pretrained``, ``float32`` (default) | ``bfloat16`` | ``float16``; a run uses
            ``pool.dtype``, so give the same to reproduce its outputs.
        batch_size: used only with ``pretrained`` (an in-memory model keeps its own batch size);
            a run uses ``tasks.batch_size``, which also changes generations (left padding): pass it
            as lm-eval's own ``batch_size`` (``simple_evaluate(batch_size=4)``, ``--batch_size 4``).
            lm-eval's ``auto`` is not supported (8 is used).
        device: used only with ``pretrained``; otherwise the wrapped model's device is reported.
        max_gen_toks: default generation budget when a request does not give ``max_gen_toks``.
        max_batch_size: accepted for lm-eval compatibility, unused.

    Raises:
        ValueError: neither or both of ``model`` and ``pretrained`` given; ``head`` or ``dtype``
            without ``pretrained``; an unknown ``dtype``.
        FileNotFoundError: the checkpoint or head files are missing (naming the file).
        TypeError: ``model`` lacks the TextModel methods.
    """

    DTYPES = ("float32", "bfloat16", "float16")

    def __init__(self, model: TextModel | None = None, *, pretrained: str | None = None,
                 head: str | None = None, dtype: str | None = None,
                 batch_size: int | str | None = None, max_batch_size: int | None = None,
                 device: str | None = None, max_gen_toks: int = 256) -> None:
        super().__init__()
        if (model is None) == (pretrained is None):
            raise ValueError("DartsBenchLM: give exactly one of `model` (a TextModel) or `pretrained` (a checkpoint dir)")
        if model is not None and (head is not None or dtype is not None):
            raise ValueError("DartsBenchLM: `head` and `dtype` apply to `pretrained` only (an in-memory model "
                             "already has its head and dtype)")
        if model is None:
            from darts_bench.evaluate.engines.hf import load_text_model

            dtype = dtype or "float32"
            if dtype not in self.DTYPES:
                raise ValueError(f"DartsBenchLM: dtype {dtype!r} not one of {self.DTYPES}")
            if str(pretrained).startswith(("/", ".", "~")) and not Path(pretrained).expanduser().is_dir():
                raise FileNotFoundError(f"DartsBenchLM: pretrained model dir {pretrained} does not exist")
            bs = int(batch_size) if batch_size is not None and str(batch_size).isdigit() else 8
            name = str(pretrained) + (f"+head:{head}" if head else "")
            model = load_text_model(pretrained, name, head or None, device=device or "cpu", dtype=dtype,
                                    batch_size=bs)
        for meth in ("generate", "score", "format_chat"):
            if not callable(getattr(model, meth, None)):
                raise TypeError(f"DartsBenchLM: {type(model).__name__} is not a TextModel (no {meth}())")
        self.model = model
        self.max_gen_toks = int(max_gen_toks)
        self._device = getattr(model, "device", device or "cpu")
        self._adds_bos_cache: bool | None = None
        #: ``(task name, doc id) -> finish reason`` of every ``generate_until`` request so far (``stop`` |
        #: ``length`` from the model's :class:`~darts_bench.api.Completion`; None: the model gives none),
        #: so a task can report how many answers hit the token cap (lm-eval's results keep text only)
        self.finish_reasons: dict[tuple[str | None, int | None], str | None] = {}
        #: generated tokens per (task, doc id) where the model gives them (``Completion.n_tokens``)
        self.n_tokens: dict[tuple[str | None, int | None], int | None] = {}

    # ----------------------------------------------------------------- tokenizer-related hooks
    @property
    def tokenizer(self):
        """The wrapped model's HF tokenizer, or ``None`` (lm-eval logs its special tokens)."""
        return getattr(self.model, "tokenizer", None)

    @property
    def max_length(self) -> int | None:
        return getattr(self.model, "max_length", None)

    @property
    def tokenizer_name(self) -> str:
        """Fingerprint for lm-eval's request cache (HFLM: ``name_or_path`` with ``/`` -> ``__``)."""
        tok = self.tokenizer
        name = getattr(tok, "name_or_path", "") if tok is not None else ""
        return (name or f"darts-bench:{getattr(self.model, 'name', type(self.model).__name__)}").replace("/", "__")

    def _tokenizer_template(self) -> str | None:
        tok = self.tokenizer
        template = getattr(tok, "chat_template", None) if tok is not None else None
        return template or None

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template string lm-eval records: the tokenizer's chat template (a named one if
        ``chat_template`` is a name and the tokenizer holds a dict), else the model's
        ``format_chat`` rendered around ``{{content}}``. ``None`` when templating is off."""
        if chat_template is False or chat_template is None:
            return None
        template = self._tokenizer_template()
        if isinstance(template, dict):
            key = chat_template if isinstance(chat_template, str) else "default"
            if key not in template:
                raise ValueError(f"chat template {key!r} not found; available: {sorted(template)}")
            return template[key]
        if template:
            return template
        return self.model.format_chat("{{content}}")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render lm-eval's chat history (``[{"role", "content"}, ...]``) as one prompt string."""
        if self._tokenizer_template():
            import jinja2

            tok = self.tokenizer
            kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                      continue_final_message=not add_generation_prompt)
            try:
                return tok.apply_chat_template(chat_history, **kw)
            except jinja2.exceptions.TemplateError:
                log.warning("chat template rejected the history; retrying without the system turn")
                return tok.apply_chat_template([m for m in chat_history if m["role"] != "system"], **kw)
        return self._render_with_format_chat(chat_history, add_generation_prompt)

    def _render_with_format_chat(self, chat_history: list[dict[str, str]], add_generation_prompt: bool) -> str:
        system = "\n\n".join(m["content"] for m in chat_history if m["role"] == "system")
        parts: list[str] = []
        turns = [m for m in chat_history if m["role"] != "system"]
        for i, m in enumerate(turns):
            if m["role"] == "user":
                content = m["content"]
                if system:
                    content, system = f"{system}\n\n{content}", ""
                parts.append(self.model.format_chat(content))
            elif m["role"] == "assistant":
                last = i == len(turns) - 1
                parts.append(m["content"] if (last and not add_generation_prompt) else m["content"] + "\n\n")
            else:
                raise ValueError(f"unsupported chat role {m['role']!r} (expected system, user, assistant)")
        if system:  # a history with only a system message
            parts.insert(0, self.model.format_chat(system))
        return "".join(parts)

    # -------------------------------------------------------------------------- text helpers
    def _adds_bos(self) -> bool:
        """Whether the wrapped model's tokenizer puts a special token in front of any text."""
        if self._adds_bos_cache is None:
            tok = self.tokenizer
            try:
                self._adds_bos_cache = tok is not None and bool(tok("", add_special_tokens=True)["input_ids"])
            except Exception:  # a tokenizer without the HF call signature
                self._adds_bos_cache = False
        return self._adds_bos_cache

    def _prefix_text(self) -> str:
        """Text standing in for lm-eval's prefix token (BOS, else EOS) before an empty context:
        ``""`` when the tokenizer adds BOS itself (or there is no tokenizer)."""
        tok = self.tokenizer
        if tok is None or self._adds_bos():
            return ""
        return getattr(tok, "bos_token", None) or getattr(tok, "eos_token", None) or ""

    def _strip_duplicate_bos(self, context: str) -> str:
        """A chat template may already start with the BOS text while the wrapped model adds BOS on
        encoding; drop the textual one (lm-eval's HFLM does the same in ``tok_encode``)."""
        tok = self.tokenizer
        bos = getattr(tok, "bos_token", None) if tok is not None else None
        if bos and context.startswith(bos) and self._adds_bos():
            return context[len(bos):]
        return context

    # ---------------------------------------------------------------------------- requests
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, one per request, in request order.

        Raises:
            ValueError: sampling (``do_sample`` or ``temperature > 0``), beam search or another
                generation option this backend cannot honour was requested.
        """
        groups: dict[tuple[tuple[str, ...], int], list[int]] = defaultdict(list)
        contexts: list[str] = []
        for idx, req in enumerate(requests):
            context, gen_kwargs = req.args[0], dict(req.args[1] or {})
            until, max_gen = self._parse_gen_kwargs(gen_kwargs)
            contexts.append(self._strip_duplicate_bos(context))
            groups[(until, max_gen)].append(idx)
        out: list[str | None] = [None] * len(requests)
        for (until, max_gen), idxs in groups.items():
            idxs = sorted(idxs, key=lambda i: -len(contexts[i]))  # longest first: less padding per batch
            texts = self.model.generate([contexts[i] for i in idxs], max_new_tokens=max_gen, stop=list(until))
            if len(texts) != len(idxs):
                raise RuntimeError(f"{type(self.model).__name__}.generate returned {len(texts)} rows for {len(idxs)} prompts")
            for i, row in zip(idxs, texts):
                text = cut_at_stop(row[0], until)
                self.finish_reasons[(getattr(requests[i], "task_name", None), getattr(requests[i], "doc_id", None))] = \
                    getattr(row[0], "finish_reason", None)
                self.n_tokens[(getattr(requests[i], "task_name", None), getattr(requests[i], "doc_id", None))] = \
                    getattr(row[0], "n_tokens", None)
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]

    def _parse_gen_kwargs(self, gen_kwargs: dict[str, Any]) -> tuple[tuple[str, ...], int]:
        do_sample = bool(gen_kwargs.pop("do_sample", False))
        temperature = float(gen_kwargs.pop("temperature", 0.0) or 0.0)
        if do_sample or temperature > 0:
            raise ValueError(f"darts-bench lm-eval backend is greedy only; got do_sample={do_sample}, "
                             f"temperature={temperature} (set do_sample: false, temperature: 0.0)")
        until = gen_kwargs.pop("until", None) or []
        if isinstance(until, str):
            until = [until]
        if not isinstance(until, (list, tuple)) or not all(isinstance(s, str) for s in until):
            raise ValueError(f"`until` must be a string or list of strings, got {until!r}")
        max_gen = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        num_beams = int(gen_kwargs.pop("num_beams", 1) or 1)
        if num_beams != 1:
            raise ValueError(f"darts-bench lm-eval backend does not do beam search (num_beams={num_beams})")
        unknown = sorted(k for k in gen_kwargs if k not in _IGNORED_UNDER_GREEDY)
        if unknown:
            raise ValueError(f"darts-bench lm-eval backend cannot honour generation kwargs {unknown}; "
                             f"supported: until, max_gen_toks, do_sample=false, temperature=0")
        return tuple(until), max_gen

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), continuation is the greedy decode)`` per request."""
        pairs: list[tuple[str, str]] = []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
            if not context:
                context = self._prefix_text()
            pairs.append((self._strip_duplicate_bos(context), continuation))
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        todo = [i for i, (_, cont) in enumerate(pairs) if cont]
        for i, (_, cont) in enumerate(pairs):
            if not cont:
                results[i] = (0.0, True)  # the empty continuation: probability 1
        if todo:
            scores = self.model.score([pairs[i][0] for i in todo], [pairs[i][1] for i in todo])
            for i, s in zip(todo, scores):
                results[i] = (-float(s.nll), bool(s.greedy))
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each whole string, conditioned on the prefix token only.

        Raises:
            ValueError: a string longer than the wrapped model's ``max_length`` tokens (it would be
                truncated, not windowed).
        """
        prefix = self._prefix_text()
        strings = [req.args[0] for req in requests]
        tok, max_len = self.tokenizer, self.max_length
        if tok is not None and max_len:
            for s in strings:
                n = len(tok(prefix + s, add_special_tokens=True)["input_ids"])
                if n > max_len:
                    raise ValueError(f"loglikelihood_rolling: string of {n} tokens exceeds the model's "
                                     f"max_length {max_len}; rolling windows are not supported by this backend")
        results: list[float] = [0.0] * len(strings)
        todo = [i for i, s in enumerate(strings) if s]
        if todo:
            scores = self.model.score([prefix] * len(todo), [strings[i] for i in todo])
            for i, s in zip(todo, scores):
                results[i] = -float(s.nll)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return results

    def get_model_info(self) -> dict[str, Any]:
        """Recorded by ``simple_evaluate`` in ``results["config"]``."""
        return {"darts_bench_model": getattr(self.model, "name", type(self.model).__name__),
                "darts_bench_backend": type(self.model).__name__}


def evaluate_task(lm: LM, task: str, task_manager, *, limit: int, seed: int, apply_chat_template: bool = False,
                  fewshot_as_multiturn: bool = False) -> dict[str, Any]:
    """``task`` (one task whose YAML sets its ``num_fewshot`` and generation settings) on ``lm`` through
    ``lm_eval.evaluate`` (lm-eval's documented entry point for a loaded model and task dict, docs/interface.md
    "External Library Usage"), set up as ``lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=...,
    limit=limit, log_samples=True, bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
    torch_random_seed=seed, fewshot_random_seed=seed, ...)`` sets it up: the three generators seeded, the task
    loaded by ``task_manager.load``, its few-shot sampler seeded (``Task.set_fewshot_seed``). The same samples
    and metrics; what ``simple_evaluate`` adds after ``evaluate`` is left out: the run's config record and
    lm-eval's environment report (torch's ``collect_env``: ``pip list`` and other subprocesses, 0.6-2.5 s a call
    on 2 cores, every GSM8K cell of a run; nothing of it is read).

    Returns:
        ``lm_eval.evaluate``'s output: ``results`` (metrics by task), ``samples`` (per document and filter), ...

    Raises:
        ValueError: ``task`` is not a single task of ``task_manager`` (a group or an unknown name).
    """
    import random

    import lm_eval
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    loaded = task_manager.load([task])
    if list(loaded["tasks"]) != [task]:
        raise ValueError(f"lm-eval task {task!r} loaded as {sorted(loaded['tasks'])} (expected the one task)")
    for t in loaded["tasks"].values():
        if t.get_config("num_fewshot") is None:
            t.set_config(key="num_fewshot", value=0)  # as simple_evaluate does for a task that leaves it unset
        t.set_fewshot_seed(seed=seed)
    return lm_eval.evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=True,
                            apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn)
