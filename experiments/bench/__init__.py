"""GPU and CPU benchmarks; every one times through experiments.bench.timing and counts FLOPs
through kimijax.train.flops."""
