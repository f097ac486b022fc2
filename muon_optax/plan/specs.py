"""Which mesh axes own the Muon matrices, how the user laid out each parameter, and along
which axis a large AdamW parameter is split."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from muon_optax.params.labels import path_str
from muon_optax.params.variables import unbox, unboxed_structure

Spec = tuple[tuple[str, ...], ...]
"""A leaf's layout: for each of its axes, the mesh axes it is split over (major first)."""


def owner_axes(axis_name: Any, mesh: Any, where: str) -> tuple[str, ...] | None:
    """``axis_name`` as a tuple of mesh axis names (None stays None), checked with ``mesh``
    as a constructor takes them, or a clear error."""
    axes = None
    if axis_name is not None:
        axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
        if not axes or not all(isinstance(a, str) for a in axes) or len(set(axes)) < len(axes):
            raise TypeError(f"axis_name must be a mesh axis name or a tuple of distinct names, "
                            f"got {axis_name!r}.")
    if mesh is None:
        return axes
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"{where}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}. Under "
            "optax.inject_hyperparams pass static_args=(\"axis_name\", \"mesh\"): a Mesh is "
            "callable (a context decorator): inject_hyperparams takes it for a schedule.")
    names = tuple(mesh.shape)
    if axes is None:
        raise ValueError(f"{where}: mesh= needs axis_name= naming the mesh axes that own the "
                         f"Muon matrices, one of {names} or a tuple of them.")
    missing = [a for a in axes if a not in names]
    if missing:
        raise ValueError(f"{where}: mesh= has axes {names}, not {missing[0]!r} "
                         f"(axis_name={axis_name!r}).")
    return axes


# Splitting a minor axis makes XLA transpose the gradient, the parameter and both moments
# every step, so the leading axis is split unless that pads it by more than this.
LEADING_AXIS_MAX_PADDING = 1 / 32


def adamw_shard_axis(shape: tuple[int, ...], num_devices: int, threshold: int) -> int | None:
    """The axis a large AdamW parameter is split along: the leading one within
    ``LEADING_AXIS_MAX_PADDING``, else the one padded least; None (all-reduced, updated
    everywhere) under ``threshold`` elements or empty."""
    if math.prod(shape) < threshold or not math.prod(shape):
        return None
    padding = [-n % num_devices for n in shape]
    if padding[0] <= LEADING_AXIS_MAX_PADDING * shape[0]:
        return 0
    return min(range(len(shape)), key=lambda a: (padding[a] * math.prod(shape) // shape[a], a))


def padded_shape(shape: tuple[int, ...], axis: int | None, num_devices: int) -> tuple[int, ...]:
    return tuple(n + -n % num_devices if a == axis else n for a, n in enumerate(shape))


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
    spec = P() if spec is None else spec
    if not isinstance(spec, P):
        raise TypeError(f"parameter {path!r}: param_specs must hold PartitionSpecs or "
                        f"NamedShardings, got {spec!r}.")
    if len(spec) > ndim:
        raise ValueError(f"parameter {path!r} has {ndim} axes but its PartitionSpec {spec} "
                         f"names {len(spec)}.")
    return tuple(() if e is None or e is P.UNCONSTRAINED else (e,) if isinstance(e, str)
                 else tuple(e) for e in list(spec) + [None] * (ndim - len(spec)))


def given_specs(param_specs: Any, params: Any, where: str) -> list[Spec]:
    """Each leaf's layout from ``param_specs``: one ``PartitionSpec`` (or ``NamedSharding``)
    for all, a tree of them like the params (``nnx.Variable`` boxes accepted), or a callable
    params -> either."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    tree = param_specs(params) if callable(param_specs) else param_specs
    try:
        given = ([tree] * len(flat) if isinstance(tree, (P, jax.sharding.NamedSharding))
                 else unboxed_structure(params).flatten_up_to(unbox(tree)))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: param_specs must have the params' structure with a "
                         "PartitionSpec at every leaf (or be a callable params -> such a "
                         "tree).") from e
    return [normalize_spec(s, len(x.shape), path_str(p)) for (p, x), s in zip(flat, given)]


def typed_spec(x: Any, path: str) -> Spec | None:
    """The layout in ``x``'s type, if its mesh axes are Explicit (else None: unknown)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
        return None
    return normalize_spec(sharding.spec, len(x.shape), path)


def placement_spec(x: Any, path: str) -> Spec | None:
    """The layout ``x`` shows: in its type (Explicit axes) or, for a placed array, in its
    ``NamedSharding``; an array on one device or in host memory is whole (replicated).
    None for a traced leaf on Auto axes (or a shape struct without a sharding)."""
    typed = typed_spec(x, path)
    if typed is not None or isinstance(x, jax.core.Tracer):
        return typed
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return normalize_spec(sharding.spec, len(x.shape), path)
    if sharding is None and isinstance(x, jax.ShapeDtypeStruct):
        return None
    return ((),) * len(x.shape)


def placed_specs(leaves: Sequence[Any], paths: Sequence[str], mesh: jax.sharding.Mesh,
                 known: Sequence[Spec] | None, where: str) -> list[Spec]:
    """Each leaf's layout over ``mesh`` without ``param_specs``: as the leaf shows it, else
    ``known`` (recorded in the state by an eager ``init``). A traced leaf on Auto axes shows
    none: taken as replicated it would be gathered whole every step, so this raises."""
    specs = [placement_spec(x, p) for x, p in zip(leaves, paths)]
    if all(s is not None for s in specs):
        return specs
    if known is not None and len(known) == len(specs):
        return [s if s is not None else k for s, k in zip(specs, known)]
    auto = [a for a, t in zip(mesh.axis_names, mesh.axis_types)
            if t == jax.sharding.AxisType.Auto and mesh.shape[a] > 1]
    if not auto:
        return [s if s is not None else ((),) * len(x.shape) for s, x in zip(specs, leaves)]
    path = paths[specs.index(None)]
    raise ValueError(
        f"{where}: parameter {path!r} is traced (jax.jit) on a mesh whose axes {auto} are "
        "AxisType.Auto: its layout is not in its type; the optimizer cannot tell how it is split. "
        "Pass param_specs= (PartitionSpecs like the params, e.g. nnx.get_partition_spec(state), "
        "or P() if all are replicated), or call tx.init eagerly on the placed params first (as "
        "nnx.Optimizer does) so its state records their layout, or use AxisType.Explicit axes.")


def check_spec(spec: Spec, shape: Sequence[int], mesh_shape: dict[str, int], path: str) -> None:
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


