"""Shared by both Muon phases: matrix hyperparameters, chunks, the kernel loop, leaf finish."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.params.layout import Stack
from muon_optax.plan.plan import TreePlan
from muon_optax.step.guard import scaled


def matrix_hparams(stack: Stack, hps: dict, slots: np.ndarray,
                   pick: Callable[[np.ndarray], Any]) -> dict[str, Any]:
    """``momentum``, ``beta2``, ``transposed`` of the stack indices ``slots`` (``(devices, n)``,
    ``-1`` read as 0), scalars when uniform; ``pick`` takes a device's row of such a table."""
    members = stack.members
    member_of = np.repeat(np.arange(len(members)), [m.batch for m in members])
    slots = np.maximum(slots, 0)
    groups = sorted({m.group for m in members})
    out: dict[str, Any] = {}
    for key in [k for k in ("momentum", "beta2") if k in hps[groups[0]]]:
        if len(groups) == 1:
            out[key] = hps[groups[0]][key]
        else:  # a stack shared by groups: each matrix's group value
            index = np.vectorize(lambda i: groups.index(members[member_of[i]].group))(slots)
            table = jnp.stack([hps[g][key] for g in groups])
            out[key] = table[jnp.asarray(pick(index))][:, None, None]
    flags = np.vectorize(lambda i: members[member_of[i]].transposed)(slots)
    out["transposed"] = (bool(flags.flat[0]) if (flags == flags.flat[0]).all()
                         else jnp.asarray(pick(flags)))
    return out


def finish_leaves(plan: TreePlan, configs: dict[str, Any], hps, directions: dict,
                  scales: dict, p_leaves, updates: list, only=None) -> None:
    """Steps 8-9 per Muon leaf (``only`` these, else all) into ``updates``: ``adaptive``'s
    ``<U, O>`` (``scales``), the cautious update in the leaf's own layout."""
    for m in plan.muon if only is None else only:
        hp, o = hps[m.group], directions[m.index]
        if m.index in scales:
            o = o.astype(jnp.float32) * scales[m.index]
        updates[m.index] = configs[m.group].leaf_update(
            o, p_leaves[m.index], hp["lr"], hp["weight_decay"], rows=m.rows, cols=m.cols)


def chunk_bytes(plan: TreePlan) -> int:
    """A chunk's budget: the largest Muon matrix's float32 bytes, so the temporaries scale
    with one large matrix (as optax's do) while smaller ones still batch."""
    return max([1] + [4 * sp.stack.rows * sp.stack.cols for sp in plan.owner.stacks])


def chunks(size: int, matrix_bytes: int, budget: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of ``size`` matrices, each at most ``budget`` bytes (or one)."""
    per = max(1, budget // matrix_bytes)
    return [(lo, min(lo + per, size)) for lo in range(0, size, per)]


def chunk_runs(spans: list[tuple[int, int]], matrix_bytes: int,
               loop_bytes: int) -> list[list[tuple[int, int]]]:
    """``spans`` (consecutive chunks) in runs of equal chunks within ``loop_bytes``."""
    out: list[list[tuple[int, int]]] = []
    for lo, hi in spans:
        size, last = hi - lo, out[-1] if out else None
        if (last and last[0][1] - last[0][0] == size
                and (len(last) + 1) * size * matrix_bytes <= loop_bytes):
            last.append((lo, hi))
        else:
            out.append([(lo, hi)])
    return out


def kernel_in_loop(stack: Stack, g_all: jax.Array, per: int, hp_all: dict, state: Any,
                   read: Callable, write: Callable, count, scale: jax.Array | None = None):
    """The rule's kernel on chunks of ``per`` of ``g_all`` (times ``scale``, if not None) in a
    ``lax.fori_loop`` (the TPU compiler's time grows with a program's kernels; a loop is one).
    State: ``read(state, first)``, ``write(state, first, new, O)``. Returns O, state, <U, O>."""
    leaf_scaled = stack.config.leaf_scaled

    def body(i, carry):
        g_all, o_all, state, d_all = carry
        at = i * per
        hp = {k: (jax.lax.dynamic_slice_in_dim(v, at, per, axis=0)
                  if jnp.ndim(v) > 0 else v) for k, v in hp_all.items()}
        g = scaled(jax.lax.dynamic_slice_in_dim(g_all, at, per, axis=0), scale)
        o, new, d = stack.config.step(g, read(state, at), hp, count, stack.dtype)
        state = write(state, at, new, o)
        if o_all is None:
            g_all = jax.lax.dynamic_update_slice_in_dim(g_all, o, at, axis=0)
        else:
            o_all = jax.lax.dynamic_update_slice_in_dim(o_all, o, at, axis=0)
        if leaf_scaled:
            d_all = jax.lax.dynamic_update_slice_in_dim(d_all, d, at, axis=0)
        return g_all, o_all, state, d_all

    n = g_all.shape[0]
    # The directions overwrite the gradient rows, unless in another dtype (a buffer then).
    o_all = None if g_all.dtype == stack.dtype else jnp.zeros(g_all.shape, stack.dtype)
    d0 = jnp.zeros((n, 1, 1) if leaf_scaled else (), jnp.float32)
    g_all, o_all, state, d_all = jax.lax.fori_loop(0, n // per, body, (g_all, o_all, state, d0))
    return (g_all if o_all is None else o_all), state, (d_all if leaf_scaled else None)
