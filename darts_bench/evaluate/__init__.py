"""Model loading, generation and scoring for evaluation (``darts_bench.evaluate``)."""
