"""Collectives along the owner axes (``N`` devices, row-major as ``jax.lax.axis_index``), as
nanochat's ``DistMuonAdamW``: reduce-scatter, update the owned share, all-gather."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.rule.order import after
from muon_optax.rule.platform import per_platform


def varying_axes(x: Any) -> frozenset[str]:
    """The mesh axes along which ``x`` may differ between devices (its type's vma)."""
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(t, "vma", ()))


# On TPU a large gradient's reduce-scatter goes in pieces of at most this many bytes.
SCATTER_PIECE_BYTES = 64 * 2**20
# The most devices whose all-gathers stay all-gathers on TPU (v5p 4x4x4: a zero-filled all-reduce).
ALL_GATHER_MAX_DEVICES = 32


class Cost(NamedTuple):
    """One device's bytes sent (ring: ``(n - 1) / n`` of a buffer, 2x all-reduce) and FLOPs."""

    sent: float = 0.0
    flops: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.sent + other.sent, self.flops + other.flops)


class Collectives:
    """Mean-reduce, scatter, gather and exchange along the owner axes. ``grads_reduced``:
    the gradients arrive averaged (plain ``jax.jit``): "reduce" means "take my share"."""

    def __init__(self, axes: tuple[str, ...] | None, grads_reduced: bool = False,
                 where: str = "muon_adamw"):
        self.axes = axes
        try:
            self.size = 1 if axes is None else math.prod(jax.lax.axis_size(a) for a in axes)
        except NameError as e:
            raise ValueError(
                f"{where}: this transformation shards over the mesh axes {axes}: call its "
                f"init and update inside jax.shard_map over a mesh with those axes, or build "
                f"it with mesh=... (plain jit) or without axis_name (one device).") from e
        # On a one-device axis the collectives still run: they make "varying" values replicated.
        self.active = axes is not None
        self.grads_reduced = grads_reduced

    def index(self) -> jax.Array | int:
        return 0 if self.size == 1 else jax.lax.axis_index(self.axes)

    def pick(self, table: np.ndarray) -> int | jax.Array | np.ndarray:
        """``table[me]`` of a static per-device table: a constant where all entries agree."""
        table = np.asarray(table)
        if (table == table[:1]).all():
            return int(table[0]) if table.ndim == 1 else table[0]
        return jnp.asarray(table)[self.index()]

    def mean(self, x: jax.Array) -> jax.Array:
        """All-reduce (mean): the small params' gradients."""
        return x if not self.active or self.grads_reduced else (
            self.sum(x) / self.size).astype(x.dtype)

    def sum(self, x: jax.Array) -> jax.Array:
        """All-reduce (sum): statistics of the shares; the device groups' rows (TPU)."""
        return jax.lax.psum(x, self.axes) if self.active else x

    def mean_scatter(self, x: jax.Array, axis: int) -> jax.Array:
        """Reduce-scatter (mean): this device's 1/N of ``x`` along ``axis``."""
        if not self.active:
            return x
        if self.grads_reduced:
            return self.local(x, axis)
        y = per_platform("scatter", x, default=self._sum_scatter(axis), tpu=lambda x: (
            self._sum_scatter_by_exchange_pieces(x, axis, SCATTER_PIECE_BYTES)))
        return (y / self.size).astype(x.dtype)

    def _sum_scatter(self, axis: int):
        return lambda x: jax.lax.psum_scatter(x, self.axes, scatter_dimension=axis, tiled=True)

    def mean_scatter_rows(self, rows: list[list[jax.Array]], length: int, piece: int,
                          dtype: Any) -> jax.Array:
        """Reduce-scatter (mean) of rows ``rows[d]`` (1-D arrays end to end, zero-padded to
        ``length``). On TPU in column pieces of ``piece``, each packed once the previous one is
        summed: the packed buffer and the all-to-all's result are never whole at once."""
        flat, unflatten = flat_rows(rows)

        def whole(*flat):
            packed = [row_slice(r, 0, length, dtype) for r in unflatten(flat)]
            return self._sum_scatter(0)(jnp.concatenate(packed))

        y = per_platform("scatter", *flat, default=whole, tpu=lambda *flat: (
            self._sum_exchange_pieces(unflatten(flat), length, piece, dtype)))
        return (y / self.size).astype(dtype)

    def _sum_exchange_pieces(self, rows: list[list[jax.Array]], length: int, piece: int,
                             dtype: Any) -> jax.Array:
        """:meth:`mean_scatter_rows`'s pieces (unscaled sums)."""
        out, prev = [], None
        for c0 in range(0, length, max(1, piece)):
            c1 = min(length, c0 + max(1, piece))
            packed = jnp.stack([after(row_slice(r, c0, c1, dtype), prev) for r in rows])
            prev = jnp.sum(jax.lax.all_to_all(packed, self.axes, 0, 0, tiled=True), axis=0)
            out.append(prev)
        return jnp.concatenate(out) if len(out) > 1 else out[0]

    def _sum_scatter_by_exchange(self, x: jax.Array, axis: int) -> jax.Array:
        """A reduce-scatter (sum) as an all-to-all and a local sum: the TPU compiler makes
        ``psum_scatter`` an all-reduce and a slice, twice the bytes."""
        n, x = self.size, jnp.moveaxis(x, axis, 0)
        rows = x.reshape((n, x.shape[0] // n) + x.shape[1:])
        y = jnp.sum(jax.lax.all_to_all(rows, self.axes, 0, 0, tiled=True), axis=0)
        return jnp.moveaxis(y, 0, axis)

    def _sum_scatter_by_exchange_pieces(self, x: jax.Array, axis: int, budget: int) -> jax.Array:
        """The same in pieces of at most ``budget`` bytes along the longest other axis (by 128s)."""
        others = [a for a in range(x.ndim) if a != axis]
        if not others or x.nbytes <= budget:
            return self._sum_scatter_by_exchange(x, axis)
        cut = max(others, key=lambda a: x.shape[a])
        size = x.shape[cut]
        width = -(-size // -(-x.nbytes // budget))
        width = -(-width // 128) * 128 if size >= 128 else width
        out, prev = [], None
        for c0 in range(0, size, width):
            part = after(jax.lax.slice_in_dim(x, c0, min(size, c0 + width), axis=cut), prev)
            prev = self._sum_scatter_by_exchange(part, axis)
            out.append(prev)
        return jnp.concatenate(out, axis=cut) if len(out) > 1 else out[0]

    def gather(self, x: jax.Array, axis: int) -> jax.Array:
        """All-gather along ``axis``, marked invariant so a step may return it with ``P()``. On
        TPU past :data:`ALL_GATHER_MAX_DEVICES` flattened first: the compiler's all-reduce of a
        zero-filled buffer holds 3 results of a 2-D gather, 2 of a 1-D (192 MiB: 576, 390)."""
        if not self.active:
            return x
        if x.ndim < 2 or self.size <= ALL_GATHER_MAX_DEVICES:
            return self._all_gather(x, axis)

        def flat(x):
            y = jnp.moveaxis(x, axis, 0)
            y = self._all_gather(y.reshape(-1), 0).reshape((-1,) + y.shape[1:])
            return jnp.moveaxis(y, 0, axis)
        return per_platform("gather", x, default=lambda x: self._all_gather(x, axis), tpu=flat)

    def _all_gather(self, x: jax.Array, axis: int) -> jax.Array:
        try:
            return jax.lax.all_gather(x, self.axes, axis=axis, tiled=True, to="invarying")
        except TypeError:  # jax before 0.10.2: no `to=`
            from jax._src.lax.parallel import all_gather_invariant

            return all_gather_invariant(x, self.axes, axis=axis, tiled=True)

    def exchange(self, x: jax.Array) -> jax.Array:
        """All-to-all of ``(N, L)``: row ``d`` to device ``d``, row ``s`` back from ``s``."""
        if self.size == 1:
            return x
        return jax.lax.all_to_all(x, self.axes, 0, 0, tiled=True)

    def local(self, x: jax.Array | np.ndarray, axis: int = 0) -> jax.Array:
        """This device's 1/N slice of a replicated array along ``axis``."""
        if self.size == 1:
            return jnp.asarray(x)
        n = x.shape[axis] // self.size
        return jax.lax.dynamic_slice_in_dim(jnp.asarray(x), self.index() * n, n, axis)


def flat_rows(rows: list[list[jax.Array]]) -> tuple[list[jax.Array], Any]:
    """``rows`` as one flat list (``lax.platform_dependent``'s operands) and its inverse."""
    ends = np.cumsum([0] + [len(r) for r in rows]).tolist()

    def unflatten(flat) -> list[list[jax.Array]]:
        return [list(flat[a:b]) for a, b in zip(ends, ends[1:])]

    return [x for r in rows for x in r], unflatten


def row_slice(parts: list[jax.Array], c0: int, c1: int, dtype: Any) -> jax.Array:
    """Elements ``c0 .. c1-1`` of ``parts`` (1-D arrays) end to end, zeros past their end."""
    out, at = [], 0
    for x in parts:
        lo, hi = max(c0, at), min(c1, at + x.shape[0])
        if lo < hi:
            out.append(x[lo - at:hi - at])
        at += x.shape[0]
    used = sum(x.shape[0] for x in out)
    if used < c1 - c0:
        out.append(jnp.zeros(c1 - c0 - used, dtype))
    return jnp.concatenate(out) if len(out) > 1 else out[0]


def pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])
