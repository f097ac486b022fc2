"""The engine behind every constructor: one optax transformation for any groups.

The data flow of one step (everything but the arithmetic is decided at trace time, in
:mod:`muon_optax.plan.plan`):

    grads, params
      -> reduced: AdamW leaves all-reduced or reduce-scattered, Muon matrices moved to
         their owners (ZeRO-2); with max_grad_norm / skip_nonfinite, the mean gradient's
         global norm and finiteness from those shares (:mod:`muon_optax.step.guard`)
      -> AdamW leaves: one fused elementwise update each (float32 math), where they lie
      -> Muon matrices, stacked by stored shape, each stack through the rule's one
         kernel (:func:`muon_optax.rule.muon.muon_step`), its state updated in place in flat
         buffers. One device: stack -> kernel -> unstack (:mod:`muon_optax.step.one_device`).
         Sharded: the same kernel on the slots a device owns, the matrices read from
         and written back to their owners (:mod:`muon_optax.step.sharded`, ``transport``)
      -> cautious update per leaf, in the leaf's own layout
      -> updates (P_new - P), new state

Three forms share this code. One device: ``axis_name=None``. ZeRO-2 inside the user's
``jax.shard_map`` (``axis_name``): params whole everywhere, per-device gradients
reduce-scattered by the optimizer. Plain ``jax.jit`` (``axis_name`` and ``mesh``): the
engine runs its own ``shard_map`` over the params' own layouts (FSDP, tensor parallel,
2-D meshes, or replicated), gradients already reduced by XLA.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax.params.labels import path_str
from muon_optax.params.variables import unbox, unboxed_structure
from muon_optax.plan.plan import TreePlan, make_tree_plan
from muon_optax.plan.specs import (
    check_spec,
    normalize_spec,
    placed_specs,
    split_spec,
    to_partition_spec,
)
from muon_optax.plan.state_layout import StateLayout, layout_error, layout_of
from muon_optax.plan.warn import warn_if_split
from muon_optax.rule.adamw import adamw_hparams, adamw_leaf_update
from muon_optax.rule.hparams import AdamWConfig, MuonConfig
from muon_optax.rule.muon import muon_hparams
from muon_optax.state.wrapped import recorder
from muon_optax.step import one_device as single
from muon_optax.step import sharded as stacks
from muon_optax.step.collectives import Collectives, Cost, pad_to, varying_axes
from muon_optax.step.guard import GradStats, from_sums, global_stats, scaled, select, sums
from muon_optax.step.one_device import MuonBuffers
from muon_optax.step.transport import Transports

# Lowering-time choice of a TPU-only form; tests force that form on CPU through this name.
platform_dependent = jax.lax.platform_dependent


class MuonAdamWState(NamedTuple):
    """State of :func:`muon_optax.muon_adamw`.

    ``mu``/``nu`` have the params' structure, with ``optax.MaskedNode()`` at Muon
    leaves; a large AdamW parameter's moments may be split over the owner axes (padded).
    ``muon`` holds the Muon state, one :class:`MuonBuffers` per parameter (and momentum)
    dtype, or on one device per stack.
    :func:`muon_optax.export_state` gives the same state per parameter.
    ``skipped`` counts the steps skipped for a non-finite gradient (int32; None unless
    the optimizer was built with ``skip_nonfinite=True``); ``count`` does not count them.
    ``layout``: the layout the state was made for (a :class:`StateLayout`, a node without
    leaves, so part of the state's structure): ``update`` refuses a state made for
    another one (:mod:`muon_optax.plan.state_layout`).
    """

    count: jax.Array                       # int32 steps taken
    mu: Any
    nu: Any
    muon: tuple[MuonBuffers, ...]
    skipped: Any = None
    layout: StateLayout | None = None


@dataclasses.dataclass(frozen=True)
class Options:
    """What :func:`build` was asked for (static)."""

    configs: Mapping[str, AdamWConfig | MuonConfig]
    param_labels: Any
    dimension_numbers: Any
    axes: tuple[str, ...] | None
    mesh: jax.sharding.Mesh | None
    param_specs: Any
    threshold: int
    name: str
    max_grad_norm: float | None = None
    skip_nonfinite: bool = False
    # Layouts seen on placed params (eager init), for the same params traced later under
    # jax.jit on AxisType.Auto axes, whose types do not carry them.
    learned: dict = dataclasses.field(default_factory=dict, compare=False)


# ------------------------------------------------------------------ plans


def leaf_specs(opts: Options, params: Any) -> list | None:
    """Each leaf's layout over ``opts.mesh`` (None in the shard_map and one-device forms).

    From ``param_specs`` if given (one ``PartitionSpec`` for all leaves, or a tree),
    else from the leaves themselves (:func:`muon_optax.plan.specs.placed_specs`).
    """
    if opts.mesh is None:
        return None
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [path_str(p) for p, _ in flat]
    leaves = [x for _, x in flat]
    if opts.param_specs is not None:
        tree = opts.param_specs(params) if callable(opts.param_specs) else opts.param_specs
        try:
            given = ([tree] * len(leaves) if isinstance(tree, (P, NamedSharding))
                     else unboxed_structure(params).flatten_up_to(unbox(tree)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{opts.name}: param_specs must have the params' structure with "
                             "a PartitionSpec at every leaf (or be a callable params -> such "
                             "a tree).") from e
        specs = [normalize_spec(s, len(x.shape), p) for s, x, p in zip(given, leaves, paths)]
    else:
        specs = placed_specs(leaves, paths, opts.mesh, opts.learned, opts.name)
    for s, x, p in zip(specs, leaves, paths):
        _check_mesh(x, opts, p)
        check_spec(s, x.shape, dict(opts.mesh.shape), p)
    return specs


def _check_mesh(x: Any, opts: Options, path: str) -> None:
    """Params on the mesh given as ``mesh=`` (as far as their type or placement shows)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    typed = getattr(sharding, "mesh", None)
    if typed is not None and getattr(typed, "axis_names", ()) and \
            dict(typed.shape) != dict(opts.mesh.shape):
        raise ValueError(f"{opts.name}: parameter {path!r} lives on a mesh with axes "
                         f"{dict(typed.shape)}, but the optimizer was built with mesh= of axes "
                         f"{dict(opts.mesh.shape)}: build it with the params' mesh.")
    placed = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
    mesh = getattr(placed, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh) and mesh.size > 1 and (
            mesh.devices.shape != opts.mesh.devices.shape
            or (mesh.device_ids != opts.mesh.device_ids).any()):
        raise ValueError(f"{opts.name}: parameter {path!r} is placed on another mesh "
                         f"({mesh}) than the optimizer's mesh= ({opts.mesh}): build it with "
                         "the params' mesh.")


def tree_plan(opts: Options, params: Any, axes: tuple[tuple[str, int], ...]) -> TreePlan:
    plan = make_tree_plan(params, opts.configs, opts.param_labels, opts.dimension_numbers,
                          axes, leaf_specs(opts, params), opts.threshold, opts.name)
    # One device runs the plain path (muon_optax.step.one_device), also under mesh= (whose
    # gradients are already reduced). ZeRO-2 on a one-device axis keeps the sharded
    # path: its collectives make the per-device gradients replicated.
    one = plan.num_devices == 1 and (opts.axes is None or opts.mesh is not None)
    return dataclasses.replace(plan, per_stack_state=one)


def _adamw_local_shape(a, n: int) -> tuple[int, ...]:
    if a.axis is None:
        return a.padded
    return a.padded[:a.axis] + (a.padded[a.axis] // n,) + a.padded[a.axis + 1:]


def check_state(plan: TreePlan, state: Any, want: Any, name: str,
                 dtypes: Sequence[Any] = ()) -> None:
    """A state made for these params (``dtypes``: theirs) and this layout, or a clear
    error."""
    got_def, want_def = jax.tree.structure(state), jax.tree.structure(want)
    needed = want.layout if isinstance(want, MuonAdamWState) else None
    other_layout = isinstance(state, MuonAdamWState) and state.layout != needed
    if other_layout:   # the leaves first: a shape or dtype says more than a layout
        want = want._replace(layout=state.layout)
        want_def = jax.tree.structure(want)
    if got_def != want_def:
        raise ValueError(f"{name}: the state was made for other params or another optimizer "
                         f"(its structure differs); call tx.init on these params.\n"
                         f"state:    {got_def}\nexpected: {want_def}")
    flat_got = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, got), w in zip(flat_got, jax.tree.leaves(want)):
        if tuple(got.shape) != tuple(w.shape):
            raise ValueError(
                f"{name}: state leaf {jax.tree_util.keystr(path)} has shape {tuple(got.shape)}"
                f", but these params on {plan.num_devices} device(s) need {tuple(w.shape)}: "
                "the state was made for other params, devices or layout; call tx.init on "
                "these params, or move it with muon_optax.export_state/import_state.")
        if got.dtype != w.dtype:
            now = [repr(p) for p, dt in zip(plan.paths, dtypes) if dt == w.dtype][:4]
            which = f" (now {w.dtype}: {', '.join(now)})" if now else ""
            raise TypeError(
                f"{name}: state leaf {jax.tree_util.keystr(path)} is {got.dtype}, but these "
                f"params need {w.dtype}: a parameter changed dtype after tx.init{which}; "
                "cast it back, or call tx.init on the params as they are now.")
    if other_layout:
        raise layout_error(name, state.layout, needed)


# ------------------------------------------------------------------ AdamW

ADAMW_FLOPS_PER_ELEMENT = 20   # moments, bias correction, decay (the cost model's)


def _adamw_grads(plan: TreePlan, comm: Collectives, g_leaves, p_leaves) -> dict[int, tuple]:
    """Each AdamW leaf's mean gradient and param, as this device updates them.

    Split params (``local``): where they lie. Whole ones: small params all-reduced (the
    same everywhere); large ones reduce-scattered along their split axis, with this
    device's slice of the param.
    """
    out = {}
    for a in plan.adamw:
        g, p = g_leaves[a.index], None if p_leaves is None else p_leaves[a.index]
        if not a.local and a.axis is None:
            g = comm.mean(g)
        elif not a.local:
            g = comm.mean_scatter(pad_to(g, a.padded), a.axis)
            p = None if p is None else comm.local(pad_to(p, a.padded), a.axis)
        out[a.index] = (g, p)
    return out


def _late_adamw(plan: TreePlan, comm: Collectives) -> tuple:
    """The ``mesh=`` form's AdamW leaves that are whole on every device but stepped split
    over the owner axes: their update is all-gathered whole for ``apply_updates``, so
    they are stepped after the Muon phase (:func:`_late_adamw_phase`)."""
    if not (comm.active and comm.grads_reduced) or plan.per_stack_state:
        return ()
    return tuple(a for a in plan.adamw if a.axis is not None and not a.local)


def _late_adamw_phase(plan: TreePlan, opts: Options, comm: Collectives, hps, t, late,
                      leaves, state, scale, updates: list, muon) -> tuple[Any, Any, Any]:
    """:func:`_adamw_grads` and :func:`_adamw_phase` for the ``late`` leaves, once the
    Muon phase is through. On TPU their inputs pass an optimization barrier with the Muon
    phase's results: the compiler otherwise steps them first and may start the gather of
    each whole update at once, holding it (a whole leaf per chip: 192 MiB for nanochat
    d768's embedding) through the Muon phase (v5e). Elsewhere the same arithmetic, no
    barrier. ``leaves``: ``(g_leaves, p_leaves)``; ``state``: the ``(mu, nu)`` trees."""
    g_leaves, p_leaves = leaves
    mu, nu = (plan.treedef.flatten_up_to(x) for x in state)
    ins = [(g_leaves[a.index], None if p_leaves is None else p_leaves[a.index],
            mu[a.index], nu[a.index]) for a in late]
    # The Muon results pass the barrier too and are taken from its outputs: a barrier
    # output nobody reads may be pruned, and with it the ordering (the last directions
    # sent back after the gathers).
    tied = ([updates[m.index] for m in plan.muon], muon)
    ins, (muon_updates, muon) = platform_dependent(
        ins, tied, default=lambda ins, tied: (ins, tied),
        tpu=lambda ins, tied: jax.lax.optimization_barrier((ins, tied)))
    for m, u in zip(plan.muon, muon_updates):
        updates[m.index] = u
    for a, (g, p, m, v) in zip(late, ins):
        g = scaled(comm.mean_scatter(pad_to(g, a.padded), a.axis), scale)
        p = None if p is None else comm.local(pad_to(p, a.padded), a.axis)
        u, mu[a.index], nu[a.index] = adamw_leaf_update(g, p, m, v, t, hps[a.group],
                                                        cfg=opts.configs[a.group])
        updates[a.index] = comm.gather(u, a.axis)[tuple(slice(0, n) for n in a.shape)]
    return plan.treedef.unflatten(mu), plan.treedef.unflatten(nu), muon


def _adamw_phase(plan: TreePlan, opts: Options, comm: Collectives, hps, t, grads: dict,
                 state, updates: list) -> tuple[Any, Any]:
    """AdamW leaves, from :func:`_adamw_grads`: fills ``updates`` (a split update is
    all-gathered back); returns the new ``(mu, nu)`` trees."""
    mu = plan.treedef.flatten_up_to(state.mu)
    nu = plan.treedef.flatten_up_to(state.nu)
    for a in plan.adamw:
        g, p = grads[a.index]
        u, mu[a.index], nu[a.index] = adamw_leaf_update(
            g, p, mu[a.index], nu[a.index], t, hps[a.group], cfg=opts.configs[a.group])
        if a.axis is not None:
            u = comm.gather(u, a.axis)[tuple(slice(0, n) for n in a.shape)]
        updates[a.index] = u
    return plan.treedef.unflatten(mu), plan.treedef.unflatten(nu)


def adamw_cost(plan: TreePlan, local_shapes: list[tuple], dtypes: list, reduced: bool) -> Cost:
    """A leaf stepped split has its gradient reduce-scattered (unless ``reduced``) and its
    update all-gathered; a small one is all-reduced (unless ``reduced``); one split where
    it lies moves nothing. ``ADAMW_FLOPS_PER_ELEMENT`` an element of ``local_shapes``."""
    n, total = plan.num_devices, Cost()
    for a in plan.adamw:
        split = not a.local and a.axis is not None
        local = math.prod(a.padded) // n if split else math.prod(local_shapes[a.index])
        ring = (n - 1) * (1 if reduced else 2) if split else \
            0 if a.local or reduced else 2 * (n - 1) / n
        total += Cost(ring * local * dtypes[a.index].itemsize, ADAMW_FLOPS_PER_ELEMENT * local)
    return total


# ------------------------------------------------------------------ state layout


def state_shapes(plan: TreePlan, shapes: list[tuple], dtypes: list, per_device: bool,
                 skipped: bool = False) -> Any:
    """The state as shape structs: one device's (``per_device``) or the global arrays.

    ``shapes`` are the leaves' shapes as the caller sees them (a device's blocks, or the
    global shapes); ``skipped``: the state counts skipped steps. The one truth for init,
    the checks and the specs.
    """
    n = plan.num_devices
    mu, nu = [optax.MaskedNode()] * len(plan.paths), [optax.MaskedNode()] * len(plan.paths)
    for a in plan.adamw:
        shape = shapes[a.index] if a.local else (
            _adamw_local_shape(a, n) if per_device else a.padded)
        mu[a.index] = jax.ShapeDtypeStruct(shape, a.mu_dtype or dtypes[a.index])
        nu[a.index] = jax.ShapeDtypeStruct(shape, dtypes[a.index])
    muon = tuple(MuonBuffers(*(jax.ShapeDtypeStruct(shape, dt) for shape, dt in zip(
        buffer_shapes(plan, key, per_device), (key[1], key[0])))) for key in plan.state_keys)
    count = jax.ShapeDtypeStruct((), jnp.int32)
    return MuonAdamWState(count, plan.treedef.unflatten(mu), plan.treedef.unflatten(nu),
                          muon, count if skipped else None, layout_of(plan))


def buffer_shapes(plan: TreePlan, key: Any, per_device: bool) -> tuple[tuple, tuple]:
    """The shapes of one state key's momentum and second-moment buffers.

    One device (``plan.per_stack_state``): the stack's own layout, ``(K, R, C)`` and
    ``(K, *second_shape)``, so that the kernel reads and writes its chunks without a
    relayout. Owners: one dimension, a device's share a 1-D run of its matrices (see
    :class:`MuonBuffers`).
    """
    if plan.per_stack_state:
        (sp,) = [sp for sp in plan.owner.stacks if sp.state_key == key]
        st = sp.stack
        return (st.size, st.rows, st.cols), (st.size,) + sp.second_shape
    rows = 1 if per_device else plan.num_devices
    return ((rows * plan.owner.momentum[key].length,),
            (rows * plan.owner.second[key].length,))


def state_partition_specs(plan: TreePlan, axes: tuple[str, ...],
                          skipped: bool = False) -> MuonAdamWState:
    """PartitionSpecs of the global state arrays."""
    moments = [optax.MaskedNode()] * len(plan.paths)
    for a in plan.adamw:
        moments[a.index] = (to_partition_spec(plan.specs[a.index]) if a.local
                            else split_spec(a.axis, axes))
    tree = plan.treedef.unflatten(moments)
    buffers = MuonBuffers(split_spec(0, axes), split_spec(0, axes))
    return MuonAdamWState(P(), tree, tree, tuple(buffers for _ in plan.state_keys),
                          P() if skipped else None, layout_of(plan))


# ------------------------------------------------------------------ the step


def check_update_args(opts: Options, grads, params) -> None:
    """What ``tx.update`` is given, checked once, before any tracing of the step: the
    params when the rule reads them, and grads of the params' structure."""
    if params is None and _needs_params(opts):
        raise ValueError(f"{opts.name}: update needs the params (Muon's cautious weight "
                         "decay and AdamW's weight decay read them): call "
                         "tx.update(grads, state, params).")
    _check_structure(grads, params, opts.name)


def _check_structure(grads, params, name: str) -> None:
    if params is not None and jax.tree.structure(grads) != jax.tree.structure(params):
        raise ValueError(f"{name}: grads and params differ in structure:\n"
                         f"grads:  {jax.tree.structure(grads)}\n"
                         f"params: {jax.tree.structure(params)}")


def _check_shapes(plan: TreePlan, g_leaves, p_leaves, name: str) -> None:
    for path, g, x in zip(plan.paths, g_leaves, p_leaves or g_leaves):
        if tuple(g.shape) != tuple(x.shape):
            raise ValueError(f"{name}: the gradient of {path!r} has shape {g.shape} but the "
                             f"parameter has shape {x.shape}.")


def _check_varying(plan: TreePlan, comm: Collectives, g_leaves, name: str) -> None:
    """Inside the user's shard_map the optimizer averages the gradients itself, so they
    must arrive per device ("varying"); jax.grad of params passed with P() returns them
    already summed over the axis (invariant)."""
    if not comm.active or comm.grads_reduced:
        return
    if not varying_axes(jax.lax.axis_index(comm.axes)):
        return  # check_vma=False: no types to read; jax.grad gives per-device gradients
    for path, g in zip(plan.paths, g_leaves):
        missing = [a for a in comm.axes if a not in varying_axes(g)]
        if missing:
            axes = comm.axes[0] if len(comm.axes) == 1 else comm.axes
            raise ValueError(
                f"{name}: the gradient of {path!r} arrives invariant over mesh axis "
                f"{missing[0]!r}, that is already summed or averaged over the devices (jax.grad"
                f" of params passed with P() inside shard_map returns the sum). This optimizer "
                f"averages per-device gradients itself: take them at "
                f"jax.lax.pcast(params, {axes!r}, to='varying') before jax.grad, or build the "
                f"optimizer with mesh=... for a plain jax.jit train step. Under optax.MultiSteps "
                f"(whose accumulator cannot hold per-device gradients between steps here): "
                f"accumulate the micro-batches' gradients inside one step and call update once "
                f"(README, 'Gradient accumulation'), or use the mesh= form.")


def _check_whole_params(plan: TreePlan, comm: Collectives, p_leaves, name: str) -> None:
    """Inside the user's shard_map the params must be whole on every device: a param
    split over an owner axis (``in_specs=P("data")``) would be orthogonalized block by
    block, a wrong step. Readable from the types under ``check_vma=True`` only."""
    if not comm.active or comm.grads_reduced or p_leaves is None:
        return
    if not varying_axes(jax.lax.axis_index(comm.axes)):
        return  # check_vma=False: no types to read
    for path, x in zip(plan.paths, p_leaves):
        split = [a for a in comm.axes if a in varying_axes(x)]
        if split:
            raise ValueError(
                f"{name}: the parameter {path!r} varies over mesh axis {split[0]!r}: inside "
                f"your shard_map this optimizer (axis_name=) needs every param whole and the "
                f"same on each device (in_specs=P()), its shape {tuple(x.shape)} the whole "
                f"parameter's. For params split over the mesh (FSDP, tensor parallel) build "
                f"it with mesh=... and call it under plain jax.jit. If these are whole copies "
                f"marked varying by jax.lax.pcast, pass tx.update the params before the pcast.")


def local_init(plan: TreePlan, opts: Options, params: Any) -> MuonAdamWState:
    leaves = plan.treedef.flatten_up_to(params)
    want = state_shapes(plan, [tuple(x.shape) for x in leaves], [x.dtype for x in leaves],
                        per_device=True, skipped=opts.skip_nonfinite)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), want)


def _zero2_stats(plan: TreePlan, opts: Options, comm: Collectives, grads: dict,
                 moves: Transports) -> GradStats:
    """:class:`GradStats` of the mean gradient from this device's reduced shares: one
    ``psum`` of two scalars over the split shares, plus the replicated small leaves."""
    split = [grads[a.index][0] for a in plan.adamw if a.axis is not None]
    split += moves.reduced_buffers()
    whole = [grads[a.index][0] for a in plan.adamw if a.axis is None]
    total = sums(whole)
    if split:
        total = total + jax.lax.psum(sums(split), comm.axes)
    return from_sums(total, opts.max_grad_norm, opts.skip_nonfinite)


def local_update(plan: TreePlan, opts: Options, grads, state, params,
                  stats: GradStats | None = None):
    """One step on this device. ``stats``: the gradient's clipping and finiteness when
    computed by the caller (the ``mesh=`` form, on the global arrays); else computed
    here from the mean gradient (one device, ZeRO-2) if the options ask for them."""
    comm = Collectives(opts.axes, grads_reduced=opts.mesh is not None, where=opts.name)
    g_leaves = plan.treedef.flatten_up_to(grads)
    p_leaves = plan.treedef.flatten_up_to(params) if params is not None else None
    _check_shapes(plan, g_leaves, p_leaves, opts.name)
    _check_varying(plan, comm, g_leaves, opts.name)
    _check_whole_params(plan, comm, p_leaves, opts.name)
    ref = p_leaves or g_leaves
    dtypes = [x.dtype for x in ref]
    check_state(plan, state, state_shapes(plan, [tuple(x.shape) for x in ref], dtypes,
                                           per_device=True, skipped=opts.skip_nonfinite),
                 opts.name, dtypes)
    count = state.count
    hps = {name: (adamw_hparams(c, count) if isinstance(c, AdamWConfig)
                  else muon_hparams(c, count)) for name, c in opts.configs.items()}
    late = _late_adamw(plan, comm)
    early = dataclasses.replace(plan, adamw=tuple(a for a in plan.adamw if a not in late))
    adamw_grads = _adamw_grads(early, comm, g_leaves, p_leaves)
    g_view, p_view = _block_views(plan, g_leaves), _block_views(plan, p_leaves)
    sharded = comm.active and not plan.per_stack_state
    moves = Transports(plan.owner, g_view, comm) if sharded else None
    if stats is None and (opts.max_grad_norm is not None or opts.skip_nonfinite):
        stats = (_zero2_stats(plan, opts, comm, adamw_grads, moves) if moves
                 else global_stats(g_leaves, opts.max_grad_norm, opts.skip_nonfinite))
    stats = stats or GradStats(None, None)
    adamw_grads = {i: (scaled(g, stats.scale), p) for i, (g, p) in adamw_grads.items()}
    updates = [None] * len(g_leaves)
    mu, nu = _adamw_phase(early, opts, comm, hps, count + 1, adamw_grads, state, updates)
    if moves is None:   # one device: stack -> kernel -> unstack
        muon = single.muon_phase(plan, opts.configs, hps, count, g_view, p_view,
                                 state.muon, stats.scale, updates)
    else:               # owners: the same kernel, the matrices moved to and from them
        moves.scale = stats.scale
        muon = stacks.muon_phase(plan, opts.configs, comm, hps, count, moves, g_view,
                                 p_view, state, updates)
    if late:
        mu, nu, muon = _late_adamw_phase(plan, opts, comm, hps, count + 1, late,
                                         (g_leaves, p_leaves), (mu, nu), stats.scale,
                                         updates, muon)
    for m in plan.muon:   # from the block views back to the leaves
        updates[m.index] = updates[m.index].reshape(g_leaves[m.index].shape)
    new_state = MuonAdamWState(optax.safe_int32_increment(count), mu, nu, muon, state.skipped,
                               state.layout)
    updates, new_state = select(stats.finite, updates, new_state, state)
    return plan.treedef.unflatten(updates), new_state


def _block_views(plan: TreePlan, leaves: list | None) -> list | None:
    """The Muon leaves in their block views (:meth:`MatrixLeaf.view`: a reshape, the
    identity without blocks); the others as they are."""
    if leaves is None:
        return None
    out = list(leaves)
    for m in plan.muon:
        out[m.index] = m.view(leaves[m.index])
    return out


def _needs_params(opts: Options) -> bool:
    return any(isinstance(c, MuonConfig) or c.needs_params() for c in opts.configs.values())


class Init:
    """``tx.init``, carrying what :func:`muon_optax.state_specs`, ``describe``,
    ``estimate`` and the portable state need to know about the transformation."""

    def __init__(self, fn: Callable, opts: Options):
        self._fn, self.options, self.configs = fn, opts, opts.configs

    def state_specs(self, params: Any, mesh: jax.sharding.Mesh) -> MuonAdamWState:
        return state_specs_of(self.options, params, mesh)

    def __call__(self, params: Any) -> MuonAdamWState:
        rec = recorder()
        if rec is not None:   # muon_optax.state_specs looking inside a wrapper
            return rec.record(self, params)
        return self._fn(params)

    def global_shapes(self, params: Any,
                      axes: tuple[tuple[str, int], ...] | None = None) -> MuonAdamWState:
        """The state's global shape structs for ``params`` over owner ``axes`` (default:
        the options' owner axes at their mesh's sizes, 1 without a mesh)."""
        if axes is None:
            mesh = dict(self.options.mesh.shape) if self.options.mesh is not None else {}
            axes = tuple((a, mesh.get(a, 1)) for a in self.options.axes or ())
        plan = tree_plan(self.options, params, axes)
        leaves = plan.treedef.flatten_up_to(params)
        return state_shapes(plan, [tuple(x.shape) for x in leaves], [x.dtype for x in leaves],
                            per_device=False, skipped=self.options.skip_nonfinite)

    def plan(self, params: Any, num_devices: int | None = None) -> TreePlan:
        """The static plan of ``params`` (for ``num_devices`` devices along one owner
        axis, or the mesh's owner axes)."""
        return tree_plan(self.options, params, owner_axis_sizes(self.options, num_devices))

    def stack_info(self, params: Any, num_devices: int | None = None) -> list[dict[str, Any]]:
        """Which matrices each stack holds and who owns them (inspection, benchmarks)."""
        plan = self.plan(params, num_devices)
        # padded: the slots every device's program holds, times the device count.
        return [dict(shape=(sp.stack.rows, sp.stack.cols), dtype=str(sp.stack.dtype),
                     size=sp.stack.size, transport=sp.transport, slots=sp.num_slots,
                     padded=sp.num_slots * plan.num_devices, counts=sp.counts.tolist(),
                     members=[m.path for m in sp.stack.members])
                for sp in plan.owner.stacks]


def init_of(tx: Any, where: str, hint: str = "") -> Init:
    """The :class:`Init` of a transformation this library built (its options, plan and
    state layout), or an error saying what ``where`` needs instead (``hint``: how)."""
    init = getattr(tx, "init", None)
    if not isinstance(init, Init):
        raise TypeError(f"{where} needs the transformation returned by muon_optax.muon_adamw "
                        "(or muon, adamw, contrib_muon) itself, not a chain or a wrapper "
                        f"around it{hint}.")
    return init


def owner_axis_sizes(opts: Options, num_devices: int | None) -> tuple[tuple[str, int], ...]:
    """The owner axes with their sizes, outside any mesh context."""
    if opts.axes is None:
        if num_devices not in (None, 1):
            raise ValueError(f"{opts.name}: this transformation was built without axis_name; "
                             "it runs on one device.")
        return ()
    if num_devices is not None:
        if len(opts.axes) > 1 and (opts.mesh is None or
                                   num_devices != math.prod(opts.mesh.shape[a]
                                                            for a in opts.axes)):
            raise ValueError(f"{opts.name}: with several owner axes {opts.axes}, give the mesh "
                             "(mesh=) rather than a device count.")
        if len(opts.axes) == 1:
            return ((opts.axes[0], int(num_devices)),)
    if opts.mesh is None:
        raise ValueError(f"{opts.name}: pass num_devices (this transformation runs inside "
                         "your own shard_map and does not know the mesh).")
    return tuple((a, opts.mesh.shape[a]) for a in opts.axes)


def local_fns(opts: Options):
    """``(init, update)`` of the one-device form and of the ``shard_map`` form (run
    inside the user's ``shard_map``, where the owner axes are bound)."""

    def axes_here() -> tuple[tuple[str, int], ...]:
        if opts.axes is None:
            return ()
        Collectives(opts.axes, where=opts.name)         # a clear error outside shard_map
        return tuple((a, jax.lax.axis_size(a)) for a in opts.axes)

    def init_fn(params):
        plan = tree_plan(opts, params, axes_here())
        if opts.axes is None:
            warn_if_split(plan.treedef.flatten_up_to(params), list(plan.paths), opts.name)
        if opts.axes is not None:
            _check_whole_params(plan, Collectives(opts.axes, where=opts.name),
                                plan.treedef.flatten_up_to(params), opts.name)
        return local_init(plan, opts, params)

    def update_fn(grads, state, params=None):
        check_update_args(opts, grads, params)
        plan = tree_plan(opts, params if params is not None else grads, axes_here())
        return local_update(plan, opts, grads, state, params)

    return init_fn, update_fn


def state_specs_of(opts: Options, params: Any, mesh: jax.sharding.Mesh) -> MuonAdamWState:
    """PartitionSpecs of the state of ``params`` on ``mesh`` (for ``shard_map`` users)."""
    if opts.axes is None:
        raise ValueError("state_specs: this transformation was built without "
                         "axis_name; pass axis_name='data' (your mesh axis) to shard it.")
    missing = [a for a in opts.axes if a not in mesh.shape]
    if missing:
        raise ValueError(f"state_specs: the mesh has axes {tuple(mesh.shape)}, not "
                         f"{missing[0]!r}.")
    axes = tuple((a, mesh.shape[a]) for a in opts.axes)
    return state_partition_specs(tree_plan(opts, params, axes), opts.axes,
                                 skipped=opts.skip_nonfinite)
