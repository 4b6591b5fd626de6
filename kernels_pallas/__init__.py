"""Pallas GPU kernels. Each module holds one kernel and a jnp-level wrapper; kimijax.ops
dispatches to them (never the model directly)."""
