"""Pallas GPU kernels, one folder per op (attnres/, attention/, kda/, mla_decode/, moe/, short_conv/), each with a
README (backend, tiles, precision, what is recomputed), common.py, the helpers they share, and
settings.py, the base of their settings. kimijax.ops dispatches to them; nothing else in kimijax
imports them (kimijax/ops/moe.py's BlockedSettings builds on settings.py, which is plain Python).

Tracing: each op's entry point checks its arguments, then calls its body under one jax.jit whose
static arguments include the kernels' settings (a frozen dataclass of kernels_pallas/<op>/settings.py,
passed from the op down to every kernel call; nothing global). A model calls an op once
per layer with the same shapes; through the shared jit those calls are one trace and one lowering,
and the lowered module holds each kernel once instead of once per layer. For the gradient of
configs/bench_350m.py:hybrid (18 KDA layers) that is 25 Triton kernels instead of 522, lowered on
the host in 10.6 s instead of 66 (experiments/tools/lowering_report.py; experiments/results/bench_kda.md).
"""
