"""The vLLM engine worker: the body of a Ray actor holding one engine (beside the HF
:class:`~darts_bench.executors.worker.ModelWorker`).

The engine class and its settings come from the vLLM backend
(:class:`~darts_bench.evaluate.engines.vllm.VLLMBackend`, through
:meth:`RayExecutor.vllm_text_model <darts_bench.executors.ray_executor.RayExecutor.vllm_text_model>`),
so this module imports no engine: it holds whatever it is given.
"""

from __future__ import annotations

from typing import Any

from darts_bench.executors.worker import MULTI_OPS, TEXT_OPS, run_multi_op, run_text_op


class VLLMWorker:
    """One engine of ``model_dir``; ``run(op, payload)`` serves ``generate_ids`` / ``generate`` /
    ``score`` / ``ping`` like :class:`~darts_bench.executors.worker.ModelWorker`, with the
    payload's ``head_dir`` (None: plain) put into the running engine for the op
    (``VLLMEngine.text_model(name, head_dir)``; the head is swapped by an RPC, no reload), and the
    multi-head ops (:data:`~darts_bench.executors.worker.MULTI_OPS`) on
    ``VLLMEngine.multi_head_model(name, head_dirs)``: each request names its head, all of them in
    one ``generate`` of the engine.

    Args:
        model_dir: the checkpoint dir the engine serves.
        engine_cls: the engine class
            (:class:`~darts_bench.evaluate.engines.vllm.VLLMEngine`, or a stand-in with its
            constructor ``(model_dir, **engine_kwargs)``, ``text_model(name, head_dir,
            batch_size=...)`` and ``shutdown()``).
        engine_kwargs: the engine's keyword arguments (``vcfg``, ``dtype``, ``seed``, ...).
        batch_size: the rows' ``tasks.batch_size`` (kept for the TextModel API).

    Attributes:
        engine_starts: engines this worker started (1).
    """

    def __init__(self, model_dir: str, engine_cls: type, engine_kwargs: dict[str, Any], batch_size: int = 8):
        self.engine = engine_cls(model_dir, **engine_kwargs)
        self.batch_size, self.engine_starts = batch_size, 1

    def run(self, op: str, payload: dict[str, Any]) -> Any:
        """Run one op (see the class docstring).

        Raises:
            ValueError: ``op`` is not ``ping`` or one of :data:`~darts_bench.executors.worker.TEXT_OPS`
                / :data:`~darts_bench.executors.worker.MULTI_OPS`.
        """
        if op == "ping":
            return "ok"
        if op in MULTI_OPS:
            mh = self.engine.multi_head_model(payload.get("name", "model"), payload["head_dirs"],
                                              batch_size=self.batch_size)
            return run_multi_op(mh, op, payload)
        if op not in TEXT_OPS:
            raise ValueError(f"unknown vLLM worker op {op!r}")
        tm = self.engine.text_model(payload.get("name", "model"), payload.get("head_dir"), batch_size=self.batch_size)
        return run_text_op(tm, op, payload)

    def close(self) -> None:
        """Shut the engine down (its engine-core and worker processes; see ``VLLMEngine.shutdown``)."""
        self.engine.shutdown()
