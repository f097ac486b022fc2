"""The owner axes, the collectives that move data along them, and leaf layouts.

nanochat's ``DistMuonAdamW`` shards the optimizer without DDP: reduce-scatter the
gradients, update only the owned share with state for only that share, all-gather the
result. Here the owner axes are one mesh axis or several (``axis_name="data"`` or
``("data", "model")``); their ``N`` devices are numbered row-major, first axis major,
as ``jax.lax.axis_index`` numbers them. :mod:`muon_optax.plan.plan` decides who owns what;
this module holds the collectives, and reads how the user laid out each parameter.

With ``axis_name=None`` the same code runs with N = 1 and every collective is the
identity: the single-device optimizer is the sharded one on one device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from muon_optax.rule.order import after
from muon_optax.state.wrapped import locate

Spec = tuple[tuple[str, ...], ...]
"""A leaf's layout: for each of its axes, the mesh axes it is split over (major first)."""


def owner_axes(axis_name: Any) -> tuple[str, ...] | None:
    """``axis_name`` as a tuple of mesh axis names (None stays None)."""
    if axis_name is None:
        return None
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not names or not all(isinstance(a, str) for a in names) or len(set(names)) < len(names):
        raise TypeError(f"axis_name must be a mesh axis name or a tuple of distinct names, "
                        f"got {axis_name!r}.")
    return names


def check_owner_args(axis_name: Any, mesh: Any, where: str) -> None:
    """``axis_name`` and ``mesh`` as a constructor takes them, or a clear error."""
    axes = owner_axes(axis_name)
    if mesh is None:
        return
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"{where}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}. Under "
            f"optax.inject_hyperparams pass static_args=(\"axis_name\", \"mesh\"): a Mesh is "
            f"callable (a context decorator) and inject_hyperparams takes every callable "
            f"for a schedule.")
    if axes is None:
        raise ValueError(f"{where}: mesh= needs axis_name= naming the mesh axes that own the "
                         f"Muon matrices, one of {tuple(getattr(mesh, 'shape', {}))} or a tuple "
                         "of them.")
    missing = [a for a in axes if a not in getattr(mesh, "shape", {})]
    if missing:
        raise ValueError(f"{where}: mesh= has axes {tuple(getattr(mesh, 'shape', {}))}, not "
                         f"{missing[0]!r} (axis_name={axis_name!r}).")


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
        y = jax.lax.platform_dependent(
            x, tpu=lambda x: self._sum_scatter_by_exchange_pieces(x, axis, SCATTER_PIECE_BYTES),
            default=self._sum_scatter(axis))
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

        y = jax.lax.platform_dependent(*flat, tpu=by_pieces, default=whole)
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


# ------------------------------------------------------------------ AdamW split axis

# A large AdamW parameter is split along its leading axis unless that needs more than
# this fraction of padding: splitting a minor axis makes XLA transpose the gradient,
# the parameter and both moments every step (BENCHMARKS.md), to save a few rows.
LEADING_AXIS_MAX_PADDING = 1 / 32


def adamw_shard_axis(shape: tuple[int, ...], num_devices: int, threshold: int) -> int | None:
    """The axis along which a large AdamW parameter is split, or None (replicated).

    Parameters under ``threshold`` elements (and scalars and empty ones, whatever the
    threshold) are all-reduced and updated everywhere.
    Otherwise the leading axis, if padding it to a multiple of N adds at most
    ``LEADING_AXIS_MAX_PADDING`` of its length; else the axis with the least padding.
    """
    if math.prod(shape) < threshold or not math.prod(shape):
        return None   # small, a scalar, or size 0 (nothing to split)
    padding = [-(-n // num_devices) * num_devices - n for n in shape]
    if padding[0] <= LEADING_AXIS_MAX_PADDING * shape[0]:
        return 0
    return min(range(len(shape)), key=lambda a: (padding[a] * math.prod(shape) // shape[a], a))


def padded_shape(shape: tuple[int, ...], axis: int | None, num_devices: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(shape)
    out = list(shape)
    out[axis] = -(-shape[axis] // num_devices) * num_devices
    return tuple(out)


def pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])


# ------------------------------------------------------------------ leaf layouts


def split_spec(axis: int | None, axes: tuple[str, ...] | None) -> P:
    """PartitionSpec of an array split along ``axis`` over the owner axes."""
    if axis is None or axes is None:
        return P()
    return P(*([None] * axis), axes[0] if len(axes) == 1 else axes)


def to_partition_spec(spec: Spec) -> P:
    """A normalized leaf layout as a ``PartitionSpec``."""
    return P(*[None if not a else a[0] if len(a) == 1 else a for a in spec])


def normalize_spec(spec: Any, ndim: int, path: str) -> Spec:
    """``PartitionSpec`` (or ``NamedSharding``) -> one tuple of mesh axes per leaf axis."""
    spec = getattr(spec, "spec", spec)
    if spec is None:
        spec = P()
    if not isinstance(spec, P):
        raise TypeError(f"parameter {path!r}: param_specs must hold PartitionSpecs or "
                        f"NamedShardings, got {spec!r}.")
    entries = list(spec) + [None] * (ndim - len(spec))
    if len(entries) > ndim:
        raise ValueError(f"parameter {path!r} has {ndim} axes but its PartitionSpec {spec} "
                         f"names {len(spec)}.")
    out = []
    for e in entries:
        if e is None or e is P.UNCONSTRAINED:
            out.append(())
        else:
            out.append((e,) if isinstance(e, str) else tuple(e))
    return tuple(out)


def typed_spec(x: Any, path: str) -> Spec | None:
    """The layout in ``x``'s type, if its mesh axes are Explicit (else None: unknown)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
        return None
    explicit = {name for name, t in zip(mesh.axis_names, mesh.axis_types)
                if t == jax.sharding.AxisType.Explicit}
    if not explicit:
        return None
    return normalize_spec(sharding.spec, len(x.shape), path)


def placement_spec(x: Any, path: str) -> Spec | None:
    """The layout ``x`` shows: in its type (Explicit axes) or, for a placed array, in its
    ``NamedSharding``; an array on one device or in host memory is whole (replicated).
    None for a traced leaf on Auto axes (or a shape struct without a sharding)."""
    typed = typed_spec(x, path)
    if typed is not None:
        return typed
    if isinstance(x, jax.core.Tracer):
        return None
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return normalize_spec(sharding.spec, len(x.shape), path)
    if sharding is None and isinstance(x, jax.ShapeDtypeStruct):
        return None
    return ((),) * len(x.shape)


def placed_specs(leaves: Sequence[Any], paths: Sequence[str], mesh: jax.sharding.Mesh,
                 learned: dict, where: str) -> list[Spec]:
    """Each leaf's layout over ``mesh`` when no ``param_specs`` were given.

    Read from the leaves (:func:`placement_spec`) and remembered in ``learned`` (keyed
    by structure and shapes): ``nnx.Optimizer`` and most users call ``init`` eagerly on
    placed params, then ``update`` under ``jax.jit``, where on ``AxisType.Auto`` axes a
    traced leaf's type does not say how it is split. Taking such a leaf as replicated
    would make XLA gather it whole every step, so where the layout was never seen this
    raises instead.
    """
    specs = [placement_spec(x, p) for x, p in zip(leaves, paths)]
    key = (tuple(paths), tuple(tuple(x.shape) for x in leaves))
    if all(s is not None for s in specs):
        learned[key] = specs
        return specs
    if key in learned:
        return [s if s is not None else known for s, known in zip(specs, learned[key])]
    auto = [a for a, t in zip(mesh.axis_names, mesh.axis_types)
            if t == jax.sharding.AxisType.Auto and mesh.shape[a] > 1]
    if not auto:
        return [s if s is not None else ((),) * len(x.shape) for s, x in zip(specs, leaves)]
    path = paths[specs.index(None)]
    raise ValueError(
        f"{where}: parameter {path!r} is traced (jax.jit) on a mesh whose axes {auto} are "
        "AxisType.Auto, so its layout is not in its type and the optimizer cannot tell how "
        "it is split. Pass param_specs= (a tree of PartitionSpecs like the params, such as "
        "nnx.get_partition_spec(state), or P() if all are replicated), or call tx.init "
        "eagerly on the placed params first (as nnx.Optimizer does) so that it learns their "
        "layout, or build the mesh with AxisType.Explicit axes.")


def check_spec(spec: Spec, shape: Sequence[int], mesh_shape: dict[str, int],
               path: str) -> None:
    """A layout the mesh can hold: known axes, used once, dividing the axis lengths."""
    used = [a for entry in spec for a in entry]
    unknown = [a for a in used if a not in mesh_shape]
    if unknown:
        raise ValueError(f"parameter {path!r} is laid out over mesh axis {unknown[0]!r}, which "
                         f"the mesh (axes {tuple(mesh_shape)}) does not have: place the params "
                         f"on the mesh given as mesh=.")
    if len(set(used)) < len(used):
        raise ValueError(f"parameter {path!r}: a mesh axis appears twice in its layout {spec}.")
    for n, entry in zip(shape, spec):
        g = math.prod(mesh_shape[a] for a in entry)
        if n % g:
            raise ValueError(f"parameter {path!r}: an axis of length {n} is split over {entry} "
                             f"({g} devices), which does not divide it.")


def state_specs(tx: Any, params: Any, mesh: jax.sharding.Mesh) -> Any:
    """PartitionSpecs of ``tx``'s state for ``jax.shard_map``'s ``in_specs``/``out_specs``.

    ``tx`` is a transformation from :func:`muon_optax.muon_adamw` (or ``muon``/``adamw``)
    built with an ``axis_name``, or a chain or wrapper holding one (``optax.chain``,
    ``MultiSteps``, ``inject_hyperparams``, ``apply_if_finite``, ``masked``/``partition``):
    the wrapper's own state gets ``P()``. ``params``: the full params (arrays or shape
    structs). Sharded leaves get the owner axes on their split axis, the rest ``P()``::

        specs = muon_optax.state_specs(tx, params, mesh)
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(),
                                      out_specs=specs))(params)
    """
    specs_fn = getattr(tx.init, "state_specs", None)
    if specs_fn is not None:
        return specs_fn(params, mesh)

    def shapes_of(init, seen):
        axes = init.options.axes or ()
        return init.global_shapes(seen, tuple((a, mesh.shape[a]) for a in axes
                                              if a in mesh.shape))

    found, shapes = locate(tx, params, shapes_of)
    if not found:
        raise TypeError("state_specs: no muon_optax transformation (muon_adamw, muon, adamw, "
                        "contrib_muon) found in this one or in its state; for a plain optax "
                        "transformation under ZeRO-2 the state is replicated: P().")
    leaves, treedef = jax.tree.flatten(shapes)
    specs = [P()] * len(leaves)
    for f in found:
        specs[f.start:f.start + f.n] = jax.tree.leaves(
            f.init.state_specs(f.params, mesh), is_leaf=lambda x: isinstance(x, P))
    return jax.tree.unflatten(treedef, specs)
