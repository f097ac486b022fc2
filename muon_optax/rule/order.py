"""Ordering XLA's schedule by data dependencies.

The engine runs stacks one after another and writes state once its old value is read.
XLA's scheduler otherwise interleaves independent computations step by step (two stacks'
polar iterations, say), so that both sets of temporaries are alive at once, or copies a
state buffer that a later read still needs. :func:`after` makes the dependency explicit;
:func:`wait_for` holds back a computation's inputs instead, by a barrier where the
compiler keeps one (TPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from muon_optax.rule.platform import per_platform


def _first(x: jax.Array) -> jax.Array:
    """``x``'s first element as a float32 scalar, sliced where it lies: ``x.reshape(-1)``
    is a relayout copy of all of ``x`` on a TPU, whose arrays are tiled."""
    return jax.lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).astype(jnp.float32).reshape(())


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
    v = _first(prev)
    zero = -(jnp.abs(jnp.where(jnp.isfinite(v), v, 0.0)) * 0.0)
    if x.dtype == jnp.float32:
        return x + zero
    return (x.astype(jnp.float32) + zero).astype(x.dtype)


def wait_for(xs, *prevs):
    """``xs`` (a pytree) unchanged, but readable only once every one of ``prevs`` (None:
    none) is computed: on TPU an ``optimization_barrier`` over them all, elsewhere
    :func:`after` on each leaf.

    Give it the inputs of the computation to hold back, not its result: what is computed
    from the barrier's outputs starts after ``prevs``, and the barrier itself makes no
    array. On TPU each :func:`after` is a pass over its ``x`` that the compiler builds a
    kernel for; XLA:CPU drops barriers, so there the arithmetic stays.
    """
    prevs = tuple(p for p in prevs if p is not None)
    if not prevs:
        return xs

    def barrier(xs, *prevs):
        return jax.lax.optimization_barrier((xs, prevs))[0]

    def arithmetic(xs, *prevs):
        for prev in prevs:
            xs = jax.tree.map(lambda x, prev=prev: after(x, prev), xs)
        return xs

    return per_platform("order", xs, *prevs, tpu=barrier, default=arithmetic)


def first_elements(xs: list[jax.Array]) -> jax.Array:
    """A float32 scalar made from one element of each of ``xs``: a value to order a
    later computation after them all (:func:`after`) that holds none of them whole, as a
    barrier over them would."""
    return sum((_first(x) for x in xs), jnp.float32(0))
