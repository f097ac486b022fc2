"""The engine behind every constructor. :func:`local_update` is one step (gradients reduced,
clip factor, AdamW leaves, Muon stacks), all but the arithmetic decided at trace time, for
one device, ZeRO-2 inside the user's ``jax.shard_map``, and plain ``jax.jit`` with ``mesh=``
(:mod:`~muon_optax.step.jit_mode`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from muon_optax.params.labels import path_str
from muon_optax.plan.plan import TreePlan, make_tree_plan
from muon_optax.plan.specs import check_spec, given_specs, placed_specs
from muon_optax.plan.warn import warn_if_split
from muon_optax.rule.hparams import AdamWConfig, MuonConfig
from muon_optax.rule.order import after, first_elements
from muon_optax.rule.platform import per_platform
from muon_optax.step import one_device, sharded
from muon_optax.step.collectives import Collectives, Cost, pad_to, varying_axes
from muon_optax.step.guard import GradStats, from_sums, global_stats, scaled, select, sums
from muon_optax.step.state import MuonAdamWState, check_state, state_shapes
from muon_optax.step.transport import Transports


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


def leaf_specs(opts: Options, params: Any, known: Any) -> list | None:
    """Each leaf's layout over ``opts.mesh`` (None without one): ``param_specs``, else the
    leaves' or, where a traced leaf does not show it, ``known`` (the state's)."""
    if opts.mesh is None:
        return None
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths, leaves = [path_str(p) for p, _ in flat], [x for _, x in flat]
    specs = (given_specs(opts.param_specs, params, opts.name) if opts.param_specs is not None
             else placed_specs(leaves, paths, opts.mesh, known, opts.name))
    for s, x, p in zip(specs, leaves, paths):
        _check_mesh(x, opts, p)
        check_spec(s, x.shape, dict(opts.mesh.shape), p)
    return specs


def _check_mesh(x: Any, opts: Options, path: str) -> None:
    """Params on the mesh given as ``mesh=`` (as far as their type or placement shows)."""
    typed = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if typed is not None and getattr(typed, "axis_names", ()) and \
            dict(typed.shape) != dict(opts.mesh.shape):
        raise ValueError(f"{opts.name}: parameter {path!r} lives on a mesh with axes "
                         f"{dict(typed.shape)}, but the optimizer was built with mesh= of axes "
                         f"{dict(opts.mesh.shape)}: build it with the params' mesh.")
    mesh = getattr(getattr(x, "sharding", None), "mesh", None) if isinstance(x, jax.Array) else None
    if isinstance(mesh, jax.sharding.Mesh) and mesh.size > 1 and (
            mesh.devices.shape != opts.mesh.devices.shape
            or (mesh.device_ids != opts.mesh.device_ids).any()):
        raise ValueError(f"{opts.name}: parameter {path!r} is placed on another mesh "
                         f"({mesh}) than the optimizer's mesh= ({opts.mesh}): build it with "
                         "the params' mesh.")


def tree_plan(opts: Options, params: Any, axes: tuple[tuple[str, int], ...],
              state: Any = None) -> TreePlan:
    """The plan of ``params``; ``state``, if given, records the layouts seen at init."""
    known = getattr(getattr(state, "layout", None), "specs", None)
    specs = leaf_specs(opts, params, known)
    plan = make_tree_plan(params, opts.configs, opts.param_labels, opts.dimension_numbers,
                          axes, specs, opts.threshold, opts.name, opts.mesh is not None)
    # One device: the plain path, also under mesh= (ZeRO-2's collectives make grads replicated).
    one = plan.num_devices == 1 and (opts.axes is None or opts.mesh is not None)
    # The state records layouts read from the params (param_specs are in the options).
    seen = None if specs is None or opts.param_specs is not None else tuple(specs)
    return dataclasses.replace(plan, per_stack_state=one, given=seen)


def _adamw_grads(plan: TreePlan, comm: Collectives, g_leaves, p_leaves) -> dict[int, tuple]:
    """Each AdamW leaf's mean gradient and param as this device steps them (:func:`adamw_cost`)."""
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


def _late_adamw_phase(plan: TreePlan, opts: Options, comm: Collectives, hps, t, late,
                      leaves, reduced: dict, moments, scale, updates: list,
                      muon) -> tuple[Any, Any, Any]:
    """:func:`_adamw_phase` for ``late`` leaves, after the Muon phase (not to hold each gathered
    update through it): on TPU behind a barrier with the Muon state and (``mesh=``) updates, or
    one element of each of ZeRO-2's. ``reduced``: ZeRO-2's shares, reduced early for the stats."""
    g_leaves, p_leaves = leaves
    mu, nu = (plan.treedef.flatten_up_to(x) for x in moments)
    # ZeRO-2's params (on one device not varying, unlike the rest) are sliced after the barrier.
    ins = [(reduced[a.index], None, mu[a.index], nu[a.index]) if a.index in reduced else
           (g_leaves[a.index], None if p_leaves is None else p_leaves[a.index],
            mu[a.index], nu[a.index]) for a in late]
    # Read on the barrier's outputs: one nobody reads may be pruned, and the order with it.
    if comm.grads_reduced:
        tied = ([updates[m.index] for m in plan.muon], muon)
        ins, (muon_updates, muon) = per_platform(
            "late_adamw", ins, tied, default=lambda ins, tied: (ins, tied),
            tpu=lambda ins, tied: jax.lax.optimization_barrier((ins, tied)))
        for m, u in zip(plan.muon, muon_updates):
            updates[m.index] = u
    else:
        def zero2_tpu(ins, muon, muon_updates):
            ins, muon = jax.lax.optimization_barrier((ins, muon))
            done = first_elements(muon_updates)
            return jax.tree.map(lambda x: after(x, done), ins), muon

        ins, muon = per_platform("late_adamw", ins, muon, [updates[m.index] for m in plan.muon],
                                 default=lambda ins, muon, _: (ins, muon), tpu=zero2_tpu)
    for a, (g, p, m, v) in zip(late, ins):
        if a.index in reduced:
            p = None if p_leaves is None else p_leaves[a.index]
        else:
            g = scaled(comm.mean_scatter(pad_to(g, a.padded), a.axis), scale)
        p = None if p is None else comm.local(pad_to(p, a.padded), a.axis)
        u, mu[a.index], nu[a.index] = opts.configs[a.group].step(g, p, m, v, t, hps[a.group])
        updates[a.index] = comm.gather(u, a.axis)[tuple(slice(0, n) for n in a.shape)]
    return plan.treedef.unflatten(mu), plan.treedef.unflatten(nu), muon


def _adamw_phase(plan: TreePlan, opts: Options, comm: Collectives, hps, t, grads: dict,
                 state, updates: list) -> tuple[Any, Any]:
    """AdamW leaves from :func:`_adamw_grads` into ``updates``; returns ``(mu, nu)``."""
    mu, nu = plan.treedef.flatten_up_to(state.mu), plan.treedef.flatten_up_to(state.nu)
    for a in plan.adamw:
        g, p = grads[a.index]
        u, mu[a.index], nu[a.index] = opts.configs[a.group].step(
            g, p, mu[a.index], nu[a.index], t, hps[a.group])
        if a.axis is not None:
            u = comm.gather(u, a.axis)[tuple(slice(0, n) for n in a.shape)]
        updates[a.index] = u
    return plan.treedef.unflatten(mu), plan.treedef.unflatten(nu)


def adamw_cost(plan: TreePlan, local: list, reduced: bool) -> Cost:
    """``local``'s leaves (a device's blocks) stepped split: gradient reduce-scattered and a small
    one all-reduced (unless ``reduced``), update all-gathered; one split where it lies: 0."""
    n, total = plan.num_devices, Cost()
    for a in plan.adamw:
        split = not a.local and a.axis is not None
        size = math.prod(a.padded) // n if split else math.prod(local[a.index].shape)
        ring = (n - 1) * (1 if reduced else 2) if split else \
            0 if a.local or reduced else 2 * (n - 1) / n
        # 20 FLOPs an element: moments, bias correction, decay (the cost model's)
        total += Cost(ring * size * local[a.index].dtype.itemsize, 20 * size)
    return total


def check_update_args(opts: Options, grads, params) -> None:
    """``tx.update``'s arguments, before tracing: params if read, grads of their structure."""
    if params is None and any(not isinstance(c, AdamWConfig) or c.needs_params()
                              for c in opts.configs.values()):
        raise ValueError(f"{opts.name}: update needs the params (Muon's cautious weight "
                         "decay and AdamW's weight decay read them): call "
                         "tx.update(grads, state, params).")
    if params is not None and jax.tree.structure(grads) != jax.tree.structure(params):
        raise ValueError(f"{opts.name}: grads and params differ in structure:\n"
                         f"grads:  {jax.tree.structure(grads)}\n"
                         f"params: {jax.tree.structure(params)}")


def _check_vma(plan: TreePlan, comm: Collectives, g_leaves, p_leaves, name: str) -> None:
    """Inside the user's shard_map (as ``check_vma=True`` types show): gradients per device
    (the optimizer averages them), params whole (else orthogonalized block by block)."""
    if not comm.active or comm.grads_reduced or not varying_axes(jax.lax.axis_index(comm.axes)):
        return
    for path, g in zip(plan.paths, g_leaves or ()):
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
    for path, x in zip(plan.paths, p_leaves or ()):
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
    want = state_shapes(plan, plan.treedef.flatten_up_to(params), per_device=True,
                        skipped=opts.skip_nonfinite)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), want)


def _zero2_stats(plan: TreePlan, opts: Options, comm: Collectives, grads: dict,
                 moves: Transports) -> GradStats:
    """:class:`GradStats` from this device's reduced shares."""
    split = [grads[a.index][0] for a in plan.adamw if a.axis is not None] + moves.reduced_buffers()
    total = sums([grads[a.index][0] for a in plan.adamw if a.axis is None])
    if split:
        total = total + comm.sum(sums(split))
    return from_sums(total, opts.max_grad_norm, opts.skip_nonfinite)


def local_update(plan: TreePlan, opts: Options, grads, state, params,
                  stats: GradStats | None = None):
    """One step on this device; ``stats``: clip factor and finiteness if the caller took them."""
    comm = Collectives(opts.axes, grads_reduced=opts.mesh is not None, where=opts.name)
    g_leaves = plan.treedef.flatten_up_to(grads)
    p_leaves = plan.treedef.flatten_up_to(params) if params is not None else None
    for path, g, x in zip(plan.paths, g_leaves, p_leaves or g_leaves):
        if tuple(g.shape) != tuple(x.shape):
            raise ValueError(f"{opts.name}: the gradient of {path!r} has shape {g.shape} but "
                             f"the parameter has shape {x.shape}.")
    _check_vma(plan, comm, g_leaves, p_leaves, opts.name)
    ref = p_leaves or g_leaves
    check_state(plan, state, state_shapes(plan, ref, per_device=True, skipped=opts.skip_nonfinite),
                opts.name, [x.dtype for x in ref])
    count = state.count
    hps = {name: c.at(count) for name, c in opts.configs.items()}
    owners = comm.active and not plan.per_stack_state
    # AdamW leaves whole on every device but stepped split go after the Muon phase (gathered).
    late = tuple(a for a in plan.adamw if a.axis is not None and not a.local) if owners else ()
    early = dataclasses.replace(plan, adamw=tuple(a for a in plan.adamw if a not in late))
    adamw_grads = _adamw_grads(early if comm.grads_reduced else plan, comm, g_leaves, p_leaves)
    g_view, p_view = _block_views(plan, g_leaves), _block_views(plan, p_leaves)
    moves = Transports(plan.owner, g_view, comm) if owners else None
    if stats is None and (opts.max_grad_norm is not None or opts.skip_nonfinite):
        stats = (_zero2_stats(plan, opts, comm, adamw_grads, moves) if moves
                 else global_stats(g_leaves, opts.max_grad_norm, opts.skip_nonfinite))
    stats = stats or GradStats(None, None)
    adamw_grads = {i: (scaled(g, stats.scale), p) for i, (g, p) in adamw_grads.items()}
    updates = [None] * len(g_leaves)
    reduced = {a.index: adamw_grads.pop(a.index)[0] for a in late if a.index in adamw_grads}
    mu, nu = _adamw_phase(early, opts, comm, hps, count + 1, adamw_grads, state, updates)
    if moves is None:   # one device: stack -> kernel -> unstack
        muon = one_device.muon_phase(plan, opts.configs, hps, count, g_view, p_view,
                                     state.muon, stats.scale, updates)
    else:               # owners: the same kernel, the matrices moved to and from them
        muon = sharded.muon_phase(plan, opts.configs, comm, hps, count, moves, stats.scale,
                                  g_view, p_view, state, updates)
    if late:
        mu, nu, muon = _late_adamw_phase(plan, opts, comm, hps, count + 1, late,
                                         (g_leaves, p_leaves), reduced, (mu, nu), stats.scale,
                                         updates, muon)
    for m in plan.muon:   # from the block views back to the leaves
        updates[m.index] = updates[m.index].reshape(g_leaves[m.index].shape)
    new_state = MuonAdamWState(optax.safe_int32_increment(count), mu, nu, muon, state.skipped,
                               state.layout)
    updates, new_state = select(stats.finite, updates, new_state, state)
    return plan.treedef.unflatten(updates), new_state


def _block_views(plan: TreePlan, leaves: list | None) -> list | None:
    """The Muon leaves in their block views (:meth:`MatrixLeaf.view`), the others as is."""
    if leaves is None:
        return None
    views = {m.index: m.view(leaves[m.index]) for m in plan.muon}
    return [views.get(i, x) for i, x in enumerate(leaves)]


def local_fns(opts: Options):
    """``(init, update)`` of the one-device and ``shard_map`` forms."""

    def axes_here() -> tuple[tuple[str, int], ...]:
        if opts.axes is None:
            return ()
        Collectives(opts.axes, where=opts.name)         # a clear error outside shard_map
        return tuple((a, jax.lax.axis_size(a)) for a in opts.axes)

    def init_fn(params):
        plan = tree_plan(opts, params, axes_here())
        if opts.axes is None:
            warn_if_split(plan.treedef.flatten_up_to(params), list(plan.paths), opts.name)
        else:
            _check_vma(plan, Collectives(opts.axes, where=opts.name), None,
                       plan.treedef.flatten_up_to(params), opts.name)
        return local_init(plan, opts, params)

    def update_fn(grads, state, params=None):
        check_update_args(opts, grads, params)
        plan = tree_plan(opts, params if params is not None else grads, axes_here())
        return local_update(plan, opts, grads, state, params)

    return init_fn, update_fn


