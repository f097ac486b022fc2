"""The collectives that move data along the owner axes.

nanochat's ``DistMuonAdamW`` shards the optimizer without DDP: reduce-scatter the
gradients, update only the owned share with state for only that share, all-gather the
result. Here the owner axes are one mesh axis or several (``axis_name="data"`` or
``("data", "model")``); their ``N`` devices are numbered row-major, first axis major,
as ``jax.lax.axis_index`` numbers them. :mod:`muon_optax.plan.plan` decides who owns
what; this module moves it.

With ``axis_name=None`` the same code runs with N = 1 and every collective is the
identity: the single-device optimizer is the sharded one on one device.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.rule.order import after
from muon_optax.rule.platform import per_platform


def _gather(x: jax.Array, axes: tuple[str, ...], axis: int) -> jax.Array:
    """All-gather marked invariant (every device holds the same value), so that a train
    step may return it with ``out_specs=P()``."""
    try:
        return jax.lax.all_gather(x, axes, axis=axis, tiled=True, to="invarying")
    except TypeError:  # jax before 0.10.2: no `to=`
        from jax._src.lax.parallel import all_gather_invariant

        return all_gather_invariant(x, axes, axis=axis, tiled=True)


def varying_axes(x: Any) -> frozenset[str]:
    """The mesh axes along which ``x`` may differ between devices (its type's vma)."""
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(t, "vma", ()))


# On TPU a large AdamW gradient's reduce-scatter (an all-to-all and a sum) goes in pieces
# of at most this many bytes of the gradient (:meth:`Collectives.mean_scatter`).
SCATTER_PIECE_BYTES = 64 * 2**20


class Cost(NamedTuple):
    """What a piece of the step costs one device: the bytes it sends (ring: ``(n - 1) / n``
    of a collective's whole buffer, twice that for an all-reduce) and its FLOPs. Adds up."""

    sent: float = 0.0
    flops: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.sent + other.sent, self.flops + other.flops)


class Collectives:
    """Mean-reduce, scatter, gather and exchange along the owner axes.

    ``grads_reduced``: the gradients arrive already averaged (plain ``jax.jit``, where
    XLA reduced them in the backward pass): then "reduce" means "take my share".
    """

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
        # On a one-device axis the collectives still run: they turn the per-device
        # ("varying") gradients into replicated values (single-participant ops).
        self.active = axes is not None
        self.grads_reduced = grads_reduced

    def index(self) -> jax.Array | int:
        return 0 if self.size == 1 else jax.lax.axis_index(self.axes)

    def pick(self, table: np.ndarray) -> int | jax.Array | np.ndarray:
        """``table[me]`` for a static table indexed by device: a constant when every
        device has the same entry."""
        table = np.asarray(table)
        if (table == table[:1]).all():
            row = table[0]
            return int(row) if row.ndim == 0 else row
        return jnp.asarray(table)[self.index()]

    def mean(self, x: jax.Array) -> jax.Array:
        """All-reduce (mean): the small params' gradients."""
        if not self.active or self.grads_reduced:
            return x
        return (jax.lax.psum(x, self.axes) / self.size).astype(x.dtype)

    def mean_scatter(self, x: jax.Array, axis: int) -> jax.Array:
        """Reduce-scatter (mean): this device's 1/N of ``x`` along ``axis``."""
        if not self.active:
            return x
        if self.grads_reduced:
            return self.local(x, axis)
        y = per_platform(
            "scatter", x, default=self._sum_scatter(axis),
            tpu=lambda x: self._sum_scatter_by_exchange_pieces(x, axis, SCATTER_PIECE_BYTES))
        return (y / self.size).astype(x.dtype)

    def _sum_scatter(self, axis: int):
        return lambda x: jax.lax.psum_scatter(x, self.axes, scatter_dimension=axis, tiled=True)

    def mean_scatter_rows(self, rows: list[list[jax.Array]], length: int, piece: int,
                          dtype: Any) -> jax.Array:
        """Reduce-scatter (mean) of a device-major buffer given by its rows: row ``d``
        is ``rows[d]`` (1-D arrays) end to end, zero-padded to ``length``; the result is
        this device's row (``dtype``), averaged over the devices.

        Elsewhere the rows are packed into one buffer and reduce-scattered at once. On
        TPU, whose reduce-scatter is an all-to-all and a sum (:meth:`mean_scatter`), they
        go in column pieces of at most ``piece`` elements a row, each packed, exchanged
        and summed before the next is packed: the packed buffer and the all-to-all's
        result (each the size of every row together) are never whole at once. The same
        bytes travel; the sums are the same, element by element.
        """
        flat, unflatten = flat_rows(rows)

        def whole(*flat):
            packed = [row_slice(r, 0, length, dtype) for r in unflatten(flat)]
            return self._sum_scatter(0)(jnp.concatenate(packed))

        def by_pieces(*flat):
            return self._sum_exchange_pieces(unflatten(flat), length, piece, dtype)

        y = per_platform("scatter", *flat, tpu=by_pieces, default=whole)
        return (y / self.size).astype(dtype)

    def _sum_exchange_pieces(self, rows: list[list[jax.Array]], length: int, piece: int,
                             dtype: Any) -> jax.Array:
        """:meth:`mean_scatter_rows`'s pieces (unscaled sums): each piece's packing waits
        for the previous piece's sum, so that one piece's buffers are alive at a time."""
        out, prev = [], None
        for c0 in range(0, length, max(1, piece)):
            c1 = min(length, c0 + max(1, piece))
            packed = jnp.stack([after(row_slice(r, c0, c1, dtype), prev) for r in rows])
            prev = jnp.sum(jax.lax.all_to_all(packed, self.axes, 0, 0, tiled=True), axis=0)
            out.append(prev)
        return jnp.concatenate(out) if len(out) > 1 else out[0]

    def _sum_scatter_by_exchange(self, x: jax.Array, axis: int) -> jax.Array:
        """A reduce-scatter (sum, along ``axis``) as an all-to-all and a local sum.

        The TPU compiler turns ``psum_scatter`` into an all-reduce of the whole operand
        and a slice: twice the bytes a reduce-scatter sends (BENCHMARKS.md, "The TPU
        compiler"). The all-to-all sends each device its 1/N of every device's operand,
        (N - 1)/N of it per device, as a ring reduce-scatter does; the device adds the N
        pieces it received, in device order.
        """
        n, x = self.size, jnp.moveaxis(x, axis, 0)
        rows = x.reshape((n, x.shape[0] // n) + x.shape[1:])
        y = jnp.sum(jax.lax.all_to_all(rows, self.axes, 0, 0, tiled=True), axis=0)
        return jnp.moveaxis(y, 0, axis)

    def _sum_scatter_by_exchange_pieces(self, x: jax.Array, axis: int,
                                        budget: int) -> jax.Array:
        """:meth:`_sum_scatter_by_exchange` in pieces of at most ``budget`` bytes of
        ``x``, cut along its longest other axis (in multiples of 128 where it is that
        long), each exchanged and summed once the previous piece's sum is: the operand's
        relaid copy and the all-to-all's result (each all of ``x``) are never whole at
        once. The same bytes travel; the sums are the same, element by element."""
        others = [a for a in range(x.ndim) if a != axis]
        if not others or x.nbytes <= budget:
            return self._sum_scatter_by_exchange(x, axis)
        cut = max(others, key=lambda a: x.shape[a])
        size = x.shape[cut]
        width = -(-size // -(-x.nbytes // budget))
        if size >= 128:
            width = -(-width // 128) * 128
        out, prev = [], None
        for c0 in range(0, size, width):
            part = after(jax.lax.slice_in_dim(x, c0, min(size, c0 + width), axis=cut), prev)
            prev = self._sum_scatter_by_exchange(part, axis)
            out.append(prev)
        return jnp.concatenate(out, axis=cut) if len(out) > 1 else out[0]

    def gather(self, x: jax.Array, axis: int) -> jax.Array:
        """All-gather: the devices' slices concatenated along ``axis``, the same everywhere."""
        return x if not self.active else _gather(x, self.axes, axis)

    def exchange(self, x: jax.Array) -> jax.Array:
        """All-to-all of ``(N, L)``: row ``d`` goes to device ``d``; row ``s`` of the
        result came from device ``s``."""
        if self.size == 1:
            return x
        return jax.lax.all_to_all(x, self.axes, 0, 0, tiled=True)

    def local(self, x: jax.Array | np.ndarray, axis: int = 0) -> jax.Array:
        """This device's 1/N slice of a replicated array along ``axis`` (no communication)."""
        if self.size == 1:
            return jnp.asarray(x)
        n = x.shape[axis] // self.size
        return jax.lax.dynamic_slice_in_dim(jnp.asarray(x), self.index() * n, n, axis)


def flat_rows(rows: list[list[jax.Array]]) -> tuple[list[jax.Array], Any]:
    """``rows`` (per device, a list of 1-D arrays) as one flat list, the operands
    ``lax.platform_dependent`` takes, and the function that puts such a list back into
    rows of the same lengths."""
    sizes = [len(r) for r in rows]

    def unflatten(flat) -> list[list[jax.Array]]:
        out, at = [], 0
        for n in sizes:
            out.append(list(flat[at:at + n]))
            at += n
        return out

    return [x for r in rows for x in r], unflatten


def row_slice(parts: list[jax.Array], c0: int, c1: int, dtype: Any) -> jax.Array:
    """Elements ``c0 .. c1-1`` of ``parts`` (1-D arrays) end to end, zeros past their
    end: static slices of the parts that overlap the range, no copy of the others."""
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
