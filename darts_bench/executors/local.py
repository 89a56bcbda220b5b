"""In-process executor: one worker, shards in order."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from darts_bench.executors.worker import ModelWorker


class LocalExecutor:
    """Runs every shard in this process, in order (the reference the Ray executor must match).

    The worker of the latest ``map`` call stays loaded, so consecutive calls on the same model
    (expert generation then expert features, or every split of one merge) load it once; a call on
    another model or :meth:`close` drops it.

    Evaluation models are not made here: the backends (:mod:`darts_bench.evaluate.engines`) load
    them in-process themselves when :attr:`in_process` is True. ``share_prefix`` goes to each
    :class:`ModelWorker` (``evaluate.share_prefix``), and ``prefix_cache_mib`` (``evaluate.prefix_cache_mib``).

    Attributes:
        in_process: True: work runs in this process (backends use their in-process layout).
    """

    name = "local"
    in_process = True

    def __init__(self, batch_size: int = 8, device: str = "cpu", torch_threads: int | None = None,
                 dtype: str = "float32", share_prefix: bool = False, prefix_cache_mib: int = 0):
        self.batch_size, self.device, self.torch_threads, self.dtype = batch_size, device, torch_threads, dtype
        self.share_prefix, self.prefix_cache_mib = share_prefix, prefix_cache_mib
        self._last: tuple[tuple, ModelWorker] | None = None

    def worker(self, model_dir: str, head_dir: str | None = None, name: str = "model") -> ModelWorker:
        """The worker for ``(model_dir, head_dir)``: the one kept from the latest call, or a new one."""
        key = (str(model_dir), str(head_dir) if head_dir else None)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        self._last = None  # free the previous model before loading the next
        w = ModelWorker(str(model_dir), head_dir=key[1], name=name, device=self.device, batch_size=self.batch_size,
                        torch_threads=self.torch_threads, dtype=self.dtype, share_prefix=self.share_prefix,
                        prefix_cache_mib=self.prefix_cache_mib)
        self._last = (key, w)
        return w

    def map(self, model_dir: str, op: str, payloads: Sequence[dict[str, Any]], *, head_dir: str | None = None,
            skip: set[int] = frozenset(), on_result: Callable[[int, Any], None] | None = None,
            desc: str = "") -> list[Any]:
        """Run ``op`` on every payload not in ``skip``; ``on_result(i, result)`` as each finishes.

        Returns:
            results in payload order (``None`` for skipped shards).
        """
        todo = [i for i in range(len(payloads)) if i not in skip]
        results: list[Any] = [None] * len(payloads)
        if not todo:
            return results
        w = self.worker(model_dir, head_dir)
        for i in tqdm(todo, desc=desc or op, leave=False, disable=len(todo) < 2):
            results[i] = w.run(op, payloads[i])
            if on_result:
                on_result(i, results[i])
        return results

    def release_idle(self) -> None:
        """Drop the kept worker (frees its model)."""
        self._last = None

    def close(self) -> None:
        self._last = None


def make_executor(cfg) -> Any:
    """The executor named by ``cfg.executor``."""
    if cfg.executor == "ray":
        from darts_bench.executors.ray_executor import RayExecutor

        # keep the latest model's actors between calls: collection runs model-major, so each
        # expert and each merge starts its actors once; Pipeline.collect releases them at the end
        return RayExecutor(cfg, keep_idle=True)
    return LocalExecutor(batch_size=cfg.calibration.batch_size, device=cfg.device, torch_threads=cfg.torch_threads,
                         dtype=cfg.pool.dtype, share_prefix=cfg.evaluate.share_prefix,
                         prefix_cache_mib=cfg.evaluate.prefix_cache_mib)
