"""Executors run model work (generation, scoring, hidden-state collection) in fixed-order shards.

``local``: one in-process worker. ``ray``: one model per Ray actor, shards spread over actors.
Both give identical outputs: shards are deterministic functions of their payload and seed.
"""

from darts_bench.executors.worker import ModelWorker, hidden_state_features

__all__ = ["ModelWorker", "hidden_state_features"]
