"""Research workflows (sweep.py, scaling_ladder.py, ablations/), benchmarks (bench/) and developer
tools (tools/). Installed editable with kimijax (`make` does it), so `python -m experiments.X`
and `from experiments.bench import timing` work from anywhere."""
