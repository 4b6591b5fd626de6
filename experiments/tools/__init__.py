"""Developer tools: profiler summaries, Triton compiler reports, kernel ablations."""
