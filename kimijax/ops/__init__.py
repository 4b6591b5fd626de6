"""Pure functions, one public function per op with impl= and the implementations it dispatches to.

The Pallas implementations import kernels_pallas lazily, inside their entries of each op's IMPLS.
What they would import during a first trace and that changes jit's trace context is imported here
instead: jax.experimental.pallas.fuser registers a config option that is part of that context, so
importing it while a jitted function traces would make that function trace and compile again on
its second call.
"""

import jax.experimental.pallas.fuser  # noqa: F401
