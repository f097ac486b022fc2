"""Ordering XLA's schedule by data dependencies: the engine runs stacks one after another
and writes state once its old value is read, where XLA's scheduler would interleave them
(both stacks' temporaries alive) or copy a state buffer a later read still needs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from muon_optax.rule.platform import per_platform


def _first(x: jax.Array) -> jax.Array:
    """``x``'s first element as a float32 scalar (a reshape would copy a tiled TPU array)."""
    return jax.lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).astype(jnp.float32).reshape(())


def after(x: jax.Array, prev: jax.Array | None) -> jax.Array:
    """``x`` unchanged, but computed only once ``prev`` is: ``x + (-0.0)`` in float32,
    the zero made from one element of ``prev`` (even inf or NaN), which XLA does not fold
    (XLA:CPU drops an ``optimization_barrier``). Subnormals flush as in any arithmetic."""
    if prev is None:
        return x
    v = _first(prev)
    zero = -(jnp.abs(jnp.where(jnp.isfinite(v), v, 0.0)) * 0.0)
    return (x.astype(jnp.float32) + zero).astype(x.dtype)  # no casts for float32


def wait_for(xs, *prevs):
    """``xs`` (a pytree) unchanged, but readable only once all ``prevs`` (None: none) are: on
    TPU by an ``optimization_barrier`` (no pass over ``xs``), elsewhere by :func:`after`."""
    prevs = tuple(p for p in prevs if p is not None)
    if not prevs:
        return xs
    def arithmetic(xs, *prevs):
        for prev in prevs:
            xs = jax.tree.map(lambda x, prev=prev: after(x, prev), xs)
        return xs
    return per_platform("order", xs, *prevs, default=arithmetic,
                        tpu=lambda xs, *prevs: jax.lax.optimization_barrier((xs, prevs))[0])


def first_elements(xs: list[jax.Array]) -> jax.Array:
    """A float32 scalar from one element of each of ``xs``, to order a computation after
    them all (:func:`after`) without holding them whole, as a barrier would."""
    return sum((_first(x) for x in xs), jnp.float32(0))
