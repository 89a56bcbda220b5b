"""Executors run model work (generation, scoring, hidden-state collection) in fixed-order shards.

``local``: one in-process worker. ``ray``: one model per Ray actor, shards spread over actors.
Both give identical outputs: shards are deterministic functions of their payload and seed.

Workers (what holds a model, in process or in a Ray actor): the HF
:class:`~darts_bench.executors.worker.ModelWorker` and the vLLM engine's
:class:`~darts_bench.executors.vllm_worker.VLLMWorker`. An executor's ``in_process`` attribute
tells the backends (:mod:`darts_bench.evaluate.engines`) which layout to use.
"""

from darts_bench.executors.worker import ModelWorker, hidden_state_features

__all__ = ["ModelWorker", "hidden_state_features"]
