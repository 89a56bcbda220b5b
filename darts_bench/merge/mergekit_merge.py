"""Merge the pool's experts with mergekit.

Methods (mergekit names) and their sources: ``linear`` (weight averaging, Wortsman et al. 2022),
``task_arithmetic`` (Ilharco et al., ICLR 2023), ``ties`` (Yadav et al., NeurIPS 2023),
``dare_ties`` / ``dare_linear`` (Yu et al., ICML 2024), ``della`` / ``della_linear`` (Deep et al. 2024,
arXiv 2406.11617, DELLA-Merging: magnitude-ranked drop probabilities in density +- epsilon, then TIES's
sign consensus or none), ``breadcrumbs`` / ``breadcrumbs_ties`` (Davari & Belilovsky, ECCV 2024, arXiv
2312.06795, Model Breadcrumbs: drop the largest ``gamma`` share and keep ``density`` of the rest, without /
with TIES's sign consensus) and ``model_stock`` (Jang et al., ECCV 2024, arXiv 2403.19522: interpolate
the experts' average towards the base by a ratio from the task vectors' mean angle; it takes no weight).
Code read: mergekit 0.1.5 ``merge_methods/registry.py`` (``GeneralizedTaskArithmeticMerge`` entries and
their ``ParameterSpec``: ``lambda`` global, ``weight`` / ``density`` / ``epsilon`` / ``gamma`` per model),
``sparsify.py`` (``della_magprune``, ``magnitude_outliers``), ``merge_methods/model_stock.py``.
DARE's and DELLA's random drop masks come from mergekit's ``random_seed`` option, set from the run
seed, so merges are reproducible. ``weight`` / ``density`` given per expert (a mapping in the spec)
go to each model's ``parameters``.

Every merge dir also holds ``mergekit_config.yml`` (:data:`MERGEKIT_CONFIG`), mergekit's own
``MergeConfiguration.to_yaml()`` of the merge with a comment naming the command that rebuilds it
(``mergekit-yaml mergekit_config.yml OUT --random-seed <seed>``; the base's generation config and
eos ids, which darts-bench carries over, are not part of it). It is written after the cached
build, outside the artifact's manifest, so an already-cached merge gets it on its next use, the
merge's cache key, weights and ``_manifest.json`` are unchanged, and a moved pool (other absolute
paths) rewrites it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from darts_bench.config import DTYPE_BYTES, MERGEKIT_OUT_SHARD_BYTES, MergeSpec, out_shard_bytes  # noqa: F401 (re-exported)
from darts_bench.merge.data import copy_base_files
from darts_bench.pool.build import Pool

log = logging.getLogger("darts_bench")
#: mergekit's own name for the merge config it writes beside a merge (``write_model_card``)
MERGEKIT_CONFIG = "mergekit_config.yml"


def merge_config_dict(spec: MergeSpec, pool: Pool, vocab_alignment: str = "error") -> dict:
    """The mergekit ``MergeConfiguration`` (as a dict) for ``spec`` over all experts of ``pool``, in
    the pool's order (``pool.experts``: any names, any number);
    ``vocab_alignment="base"`` merges on the base's tokenizer (``tokenizer_source: base``)."""
    models = []
    for name, path in pool.experts.items():
        params: dict = {} if spec.method == "model_stock" else {"weight": spec.expert_value("weight", name)}
        if spec.density is not None:
            params["density"] = spec.expert_value("density", name)
        for f in ("epsilon", "gamma"):  # mergekit scopes them per model (ParameterScope.NON_BASE)
            if getattr(spec, f) is not None:
                params[f] = getattr(spec, f)
        models.append({"model": str(path), "parameters": params} if params else {"model": str(path)})
    cfg: dict = {"merge_method": spec.method, "models": models, "dtype": spec.dtype}
    if spec.method != "linear":
        cfg["base_model"] = str(pool.base)
    if vocab_alignment == "base":  # the base's tokenizer, by path (linear has no base_model)
        cfg["tokenizer_source"] = str(pool.base)
    glob: dict = {}
    if spec.normalize is not None:
        glob["normalize"] = spec.normalize
    if spec.method in ("ties", "dare_ties", "dare_linear") and spec.int8_mask:
        glob["int8_mask"] = True
    if spec.lambda_ is not None:
        glob["lambda"] = spec.lambda_
    if spec.filter_wise is not None:
        glob["filter_wise"] = spec.filter_wise
    if glob:
        cfg["parameters"] = glob
    return cfg


def merge_bytes(base_dir: Path, dtype: str) -> int:
    """Bytes of a merge written in ``dtype`` (``float32`` / ``bfloat16`` / ``float16``) over the base in
    ``base_dir``: the base's element count (safetensors headers only, one file or shards) times the
    dtype's size.

    Raises:
        FileNotFoundError: ``base_dir`` has no ``*.safetensors`` file.
    """
    import math

    from safetensors import safe_open

    files = sorted(Path(base_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{base_dir}: no *.safetensors weights")
    n = 0
    for f in files:
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n * DTYPE_BYTES[dtype]


def _malloc_trim():
    """glibc's ``malloc_trim(0)`` as a no-argument callable (a no-op where the C library has none,
    e.g. musl or macOS: only memory is at stake, never a result).

    Why: glibc serves the merge's tensor temporaries from its heap once its dynamic mmap threshold
    has risen (after the first large free), and keeps freed heap memory resident; which chunks stay
    depends on the order mergekit frees them (hash-seed dependent), so the merge's anonymous peak
    varied from 1.3x to 1.7x a model between runs of ``benchmarks/bench_merge_memory.py``. Trimming
    before each input tensor returns the freed pages (about 10 us a call with a small heap)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    fn = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if fn is None:
        return lambda: None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


def _streaming_loader_class():
    """A :class:`mergekit.io.lazy_tensor_loader.LazyTensorLoader` that closes its shard after every tensor.

    mergekit reads safetensors through ``safetensors.safe_open`` (a file mapping per shard, kept open
    in ``LoaderCache`` until the process ends), so every page of every input it has read stays in the
    process's resident set: a 3-expert merge peaks at the 4 input models (file-backed) plus the
    output shard. Closing the shard after each ``get_tensor`` leaves the returned tensor a view of its
    own mapping, unmapped when mergekit's executor drops the tensor after its last use; the merge then
    holds only the tensors in flight plus the output shard it is writing. Same bytes, same order.
    """
    from mergekit.io.lazy_tensor_loader import LazyTensorLoader

    trim = _malloc_trim()

    class StreamingTensorLoader(LazyTensorLoader):
        def get_tensor(self, key, device="cpu", aliases=None, raise_on_missing=True):
            trim()  # the previous tensor's freed temporaries go back to the OS before the next one's
            try:
                return super().get_tensor(key, device=device, aliases=aliases, raise_on_missing=raise_on_missing)
            finally:
                self.flush()

    return StreamingTensorLoader


def run_one_merge(cfg_dict: dict, out: Path, seed: int, base_dir: Path, stream: bool = True,
                  out_shard_size: int | None = None) -> None:
    """Run mergekit into ``out`` and carry over the base's generation config (eos/pad ids).

    ``stream=True`` (default) reads each input tensor through its own short-lived file mapping
    (:func:`_streaming_loader_class`, put into mergekit's ``LoaderCache`` for this merge's models and
    removed afterwards), so the merge peaks near one output shard plus the tensors in flight instead of
    all inputs plus the output; the written files are byte-identical to ``stream=False`` (mergekit's own
    loaders), hence not in the cache key. ``out_shard_size`` (bytes, mergekit's ``MergeOptions`` option)
    bounds the output shard mergekit holds; ``None`` (default): :func:`out_shard_bytes` of the merge's size
    (the base's tensors in the merge's ``dtype``), so a merge above 64 MiB is written in about 8 shards.
    The shard layout is not in the cache key either: the tensors are the same whatever the shards.
    Either way the merge's loaders leave ``LoaderCache`` afterwards (mergekit would keep every input
    mapped for the rest of the process); entries another caller had put there are restored.
    Models with a LoRA (``model+lora``, never written by :func:`merge_config_dict`) keep mergekit's
    loader, which applies the LoRA first.

    Raises:
        RuntimeError: mergekit wrote no weights, or the merged eos ids differ from the base's.
    """
    from mergekit.config import MergeConfiguration
    from mergekit.io.lazy_tensor_loader import ShardedTensorIndex
    from mergekit.io.tasks import LoaderCache
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    conf = MergeConfiguration.model_validate(cfg_dict)
    if out_shard_size is None:
        out_shard_size = out_shard_bytes(merge_bytes(base_dir, cfg_dict.get("dtype") or "float32"))
    cache = LoaderCache()
    refs = list(conf.referenced_models())
    saved = {r: cache.loaders.pop(r) for r in refs if r in cache.loaders}
    if stream:
        streaming = _streaming_loader_class()
        for r in refs:
            if r.lora is None:
                cache.loaders[r] = streaming(ShardedTensorIndex.from_disk(r.local_path()), lazy_unpickle=False)
    try:
        run_merge(conf, str(out), options=MergeOptions(random_seed=seed, copy_tokenizer=True, lazy_unpickle=False,
                                                       write_model_card=False, quiet=True, safe_serialization=True,
                                                       out_shard_size=out_shard_size))
    finally:
        for r in refs:  # close every mapping this merge opened (mergekit keeps them for the process's life)
            loader = cache.loaders.pop(r, None)
            if loader is not None:
                loader.flush()
        cache.loaders.update(saved)
    if not any(out.glob("*.safetensors")):
        raise RuntimeError(f"mergekit wrote no safetensors into {out}")
    copy_base_files(base_dir, out)


def mergekit_config_text(cfg_dict: dict, seed: int) -> str:
    """The ``mergekit_config.yml`` of a merge: a comment with the rebuild command, then mergekit's
    ``MergeConfiguration.model_validate(cfg_dict).to_yaml()`` (what ``mergekit-yaml`` reads).

    Raises:
        pydantic.ValidationError: ``cfg_dict`` is not a valid mergekit configuration.
    """
    from mergekit.config import MergeConfiguration

    body = MergeConfiguration.model_validate(cfg_dict).to_yaml()
    return (f"# written by darts-bench; rebuild the weights with mergekit alone:\n"
            f"#   mergekit-yaml {MERGEKIT_CONFIG} OUT_DIR --random-seed {seed} --copy-tokenizer\n"
            f"# (darts-bench then copies the base's generation_config.json and eos ids into the merge dir)\n"
            + body)


def write_mergekit_config(merge_dir: Path, cfg_dict: dict, seed: int) -> Path:
    """Write :func:`mergekit_config_text` to ``merge_dir/mergekit_config.yml`` when it is missing or
    differs (atomically; not in the artifact manifest, so a cached merge stays valid). Returns the path."""
    from darts_bench.artifacts import atomic_write_text

    path = merge_dir / MERGEKIT_CONFIG
    text = mergekit_config_text(cfg_dict, seed)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        atomic_write_text(path, text)
    return path
