"""Device-major buffers' rows: where a stack's matrices lie, the static slicing to pack them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.params.layout import Stack
from muon_optax.plan.plan import Channel, StackPlan
from muon_optax.rule.platform import per_platform

# A TPU holds an array's two minor dimensions in tiles of 8 x 128 (16- and 32-bit types).
_TILE = (8, 128)


def _tiled(shape: tuple[int, ...], dtype: Any, item: int) -> bool:
    return (item >= 2 and shape[-2] % _TILE[0] == 0 and shape[-1] % _TILE[1] == 0
            and jnp.dtype(dtype).itemsize in (2, 4))


def flat(x: jax.Array, item: int = 2) -> jax.Array:
    """``x`` 1-D for a transport's buffer, its last ``item`` dimensions one item. On TPU, where
    these are whole tiles, tile by tile as the TPU holds it: a bitcast both ways, where
    row-major order is a relayout copy."""
    def tiles(x):
        (r, c), lead = x.shape[-2:], x.shape[:-2]
        y = x.reshape(lead + (r // _TILE[0], _TILE[0], c // _TILE[1], _TILE[1]))
        return jnp.swapaxes(y, -3, -2).reshape(-1)

    if not _tiled(x.shape, x.dtype, item):
        return x.reshape(-1)
    return per_platform("tiles", x, tpu=tiles, default=lambda x: x.reshape(-1))


def shaped(x: jax.Array, shape: tuple[int, ...], item: int = 2) -> jax.Array:
    """Inverse of :func:`flat`: ``x`` (any shape of that size) as an array of ``shape``."""
    shape = tuple(shape)

    def tiles(x):
        (r, c), lead = shape[-2:], shape[:-2]
        y = x.reshape(lead + (r // _TILE[0], c // _TILE[1], _TILE[0], _TILE[1]))
        return jnp.swapaxes(y, -3, -2).reshape(shape)

    if not _tiled(shape, x.dtype, item):
        return x.reshape(shape)
    return per_platform("tiles", x, tpu=tiles, default=lambda x: x.reshape(shape))


def take_static(x: jax.Array, index: np.ndarray, axis: int = 0) -> jax.Array:
    """``x`` indexed along ``axis`` by a static index: a no-op for the identity."""
    index = np.asarray(index)
    if index.shape[0] == x.shape[axis] and (index == np.arange(index.shape[0])).all():
        return x
    return jnp.take(x, jnp.asarray(index), axis=axis)


def member_runs(stack: Stack, indices: np.ndarray) -> list[tuple[int, int, int]]:
    """Stack indices as runs ``(member, lo, hi)``, consecutive in the stack and ``indices``."""
    starts = np.cumsum([0] + [m.batch for m in stack.members])
    runs: list[tuple[int, int, int]] = []
    for i in indices.tolist():
        member = int(np.searchsorted(starts, i, side="right")) - 1
        local = i - int(starts[member])
        if runs and runs[-1][0] == member and runs[-1][2] == local:
            runs[-1] = (member, runs[-1][1], local + 1)
        else:
            runs.append((member, local, local + 1))
    return runs


def owned_parts(sp: StackPlan, members: list[jax.Array], parts: list[list[jax.Array]],
                flatten=lambda x: x.reshape(-1)) -> None:
    """Appends device ``d``'s matrices of ``sp``, ``flatten``-ed, to ``parts[d]`` (no gather)."""
    for d, row in enumerate(sp.slots):
        for member, lo, hi in member_runs(sp.stack, row[row >= 0]):
            parts[d].append(flatten(members[member][lo:hi]))


def dynamic_slice(x: jax.Array, start: int | jax.Array, size: int, axis: int) -> jax.Array:
    if isinstance(start, int):
        return jax.lax.slice_in_dim(x, start, start + size, axis=axis)
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def dynamic_update(x: jax.Array, update: jax.Array, start: int | jax.Array, axis: int,
                   owned: jax.Array | None = None) -> jax.Array:
    """``update`` into ``x`` at ``start`` where ``owned`` (None: everywhere), else ``x`` kept."""
    if owned is not None:
        update = jnp.where(owned, update, dynamic_slice(x, start, update.shape[axis], axis))
    return jax.lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), start, axis=axis)


def member_spans(channel: Channel, k: int, sp: StackPlan, size: int) -> list[list[tuple[int, int]]]:
    """Per member, ``(device, start)`` of each of stack ``k``'s matrices in a ``channel``."""
    spans = [(d, int(channel.offsets[k, d]) + j * size)
             for d, j in zip(sp.owners.tolist(), sp.slot_of().tolist())]
    ends = np.cumsum([m.batch for m in sp.stack.members]).tolist()
    return [spans[a:b] for a, b in zip([0] + ends, ends)]


def member_rows(buf: jax.Array, channel: Channel, k: int, sp: StackPlan,
                size: int) -> list[jax.Array]:
    """Per member, stack ``k``'s matrices ``(batch, size)`` from an ``(N, L)`` ``channel``."""
    return [jnp.stack([buf[d, at:at + size] for d, at in spans])
            for spans in member_spans(channel, k, sp, size)]


def lane_of(dtype: Any, *sizes: Any) -> int:
    """The unit a buffer's rows are cut in: a TPU tile of ``dtype`` (8 or 16 x 128) where all
    ``sizes`` are whole tiles, else 1. As :func:`lanes` lays it out a matrix is cut out
    without the strided copy an ``(N, L)`` piece needs."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize not in (2, 4):
        return 1
    unit = _TILE[0] * (4 // itemsize) * _TILE[1]
    return unit if all((np.asarray(s) % unit == 0).all() for s in sizes) else 1


def lanes(x: jax.Array, lane: int) -> jax.Array:
    """``x``'s last axis (``L``) as ``(L / lane, rows, 128)``; ``x`` itself for lane 1."""
    if lane == 1:
        return x
    return x.reshape(x.shape[:-1] + (x.shape[-1] // lane, lane // _TILE[1], _TILE[1]))


def span(got: list[jax.Array], bounds: list[tuple[int, int]], d: int, at: int,
         size: int, lane: int = 1) -> jax.Array:
    """Elements ``at .. at+size-1`` of device ``d``'s row from the gathered pieces (each
    ``(N, width)``, or in :func:`lanes`: then so is the result)."""
    parts = [got[p][d, (max(at, c0) - c0) // lane:(min(at + size, c1) - c0) // lane]
             for p, (c0, c1) in enumerate(bounds) if c0 < at + size and at < c1]
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]
