"""Global-norm clipping and skipped non-finite steps, on the mean gradient ``g``:

    norm   = sqrt(sum over every element of every leaf of g^2)
    scale  = 1 if norm < max_grad_norm else max_grad_norm / norm
    finite = every element of g is finite

as ``optax.clip_by_global_norm`` on the global batch; a non-finite step returns zero updates
and the old state, one more ``skipped``. Under ZeRO-2 a transform chained before the
optimizer would see one device's gradient, so these run in the step (one ``psum``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from muon_optax.plan.plan import TreePlan
from muon_optax.rule.hparams import check_flag, concrete_value
from muon_optax.step.collectives import Cost


class GradStats(NamedTuple):
    """What a step does with its gradient (None: that option is off)."""

    scale: jax.Array | None    # float32 factor of the mean gradient
    finite: jax.Array | None   # bool: every element finite


def sums(leaves: Iterable[jax.Array]) -> jax.Array:
    """``[sum of g^2, count of non-finite elements]`` over ``leaves``, float32."""
    total = jnp.zeros(2, jnp.float32)
    for g in leaves:
        g32 = g.astype(jnp.float32)
        total = total + jnp.stack([jnp.sum(g32 * g32),
                                   jnp.sum(~jnp.isfinite(g32), dtype=jnp.float32)])
    return total


def from_sums(total: jax.Array, max_grad_norm: float | None, skip: bool) -> GradStats:
    """:class:`GradStats` from the summed ``[sum of g^2, non-finite count]``."""
    scale = None
    if max_grad_norm is not None:
        norm = jnp.sqrt(total[0])
        scale = jnp.where(norm < max_grad_norm, 1.0, max_grad_norm / norm)
    return GradStats(scale, total[1] == 0 if skip else None)


def stats_cost(plan: TreePlan, given: list, reduced: bool, on: bool) -> Cost:
    """When ``on``, all-reduces of float32 pairs: ZeRO-2's one if a share is reduce-scattered;
    under ``mesh=`` one per leaf split where it lies (``given``)."""
    pairs = (sum(1 for spec in given if any(spec)) if reduced else int(bool(plan.owner.gather)
             or any(a.axis is not None and not a.local for a in plan.adamw)))
    return Cost(2 * (plan.num_devices - 1) / plan.num_devices * 2 * 4 * pairs if on else 0.0)


def global_stats(grads: Any, max_grad_norm: float | None, skip: bool) -> GradStats:
    """:class:`GradStats` of gradients that are the mean already (one device, ``mesh=``)."""
    return from_sums(sums(jax.tree.leaves(grads)), max_grad_norm, skip)


def scaled(g: jax.Array, scale: jax.Array | None) -> jax.Array:
    """``g * scale`` in float32, back in ``g``'s dtype (as a clipped gradient arrives)."""
    return g if scale is None else (g.astype(jnp.float32) * scale).astype(g.dtype)


def select(finite: jax.Array | None, updates: list, new_state: Any, old_state: Any):
    """``(updates, state)`` if ``finite``, else zero updates and the old state, one more skipped."""
    if finite is None:
        return updates, new_state
    updates = [jnp.where(finite, u, jnp.zeros((), u.dtype)) for u in updates]
    kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                        new_state._replace(skipped=None), old_state._replace(skipped=None))
    skipped = old_state.skipped + jnp.where(finite, 0, 1).astype(old_state.skipped.dtype)
    return updates, kept._replace(skipped=skipped)


def check_options(max_grad_norm: Any, skip_nonfinite: Any, where: str) -> Any:
    """The two options as the constructors take them, or a clear error. A 0-d array is kept
    (``optax.inject_hyperparams`` hands in numbers as arrays, which it keeps in the state)."""
    check_flag(skip_nonfinite, "skip_nonfinite", where)
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, jax.Array) and max_grad_norm.ndim == 0:
        # Checked if concrete (a traced one is known only when the step runs).
        if concrete_value(max_grad_norm) is not None:
            check_options(concrete_value(max_grad_norm), skip_nonfinite, where)
        return max_grad_norm
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real) \
            or not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
        raise ValueError(f"{where}: max_grad_norm must be a positive number (the largest "
                         f"global norm of the mean gradient) or None, got {max_grad_norm!r}.")
    return float(max_grad_norm)
