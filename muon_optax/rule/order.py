"""Ordering XLA's schedule by data dependencies.

The engine runs stacks one after another and writes state once its old value is read.
XLA's scheduler otherwise interleaves independent computations step by step (two stacks'
polar iterations, say), so that both sets of temporaries are alive at once, or copies a
state buffer that a later read still needs. :func:`after` makes the dependency explicit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def after(x: jax.Array, prev: jax.Array | None) -> jax.Array:
    """``x`` unchanged, but computed only once ``prev`` is.

    XLA's scheduler otherwise interleaves independent computations step by step (two
    stacks' polar iterations, say), so both sets of buffers are alive at once. The
    dependency is ``x + (-0.0)``, the zero made from one element of ``prev``: ``x`` bit
    for bit (signed zeros, inf and NaN included; subnormals are flushed, as by any
    XLA:CPU arithmetic), and still ``-0.0`` when ``prev`` holds inf or NaN. XLA does
    not fold float arithmetic on a runtime value, so the dependency survives
    optimisation (an ``optimization_barrier`` did not: XLA:CPU dropped it). The zero is
    made and added in float32 (exact for any float ``x``; no narrow-dtype scalars).
    """
    if prev is None:
        return x
    # One element, sliced where it lies: prev.reshape(-1) is a relayout copy of all of
    # prev on a TPU, whose arrays are tiled.
    v = jax.lax.slice(prev, (0,) * prev.ndim, (1,) * prev.ndim).astype(jnp.float32).reshape(())
    zero = -(jnp.abs(jnp.where(jnp.isfinite(v), v, 0.0)) * 0.0)
    if x.dtype == jnp.float32:
        return x + zero
    return (x.astype(jnp.float32) + zero).astype(x.dtype)
