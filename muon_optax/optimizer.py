"""``muon_adamw``: nanochat's MuonAdamW as one optax transformation.

The data flow of one step (everything but the arithmetic is decided at trace time):

    grads, params
      -> labels: a group per leaf
      -> AdamW leaves: one fused elementwise update each (float32 math)
      -> Muon leaves: canonical (out, in) matrices, stored wide, stacked by shape
         -> one batched Muon program per stack -> unstacked to each leaf's layout
      -> updates (P_new - P), new state

With ``axis_name`` the same step runs inside ``jax.shard_map`` as ZeRO-2 (see
:mod:`muon_optax.sharding`): gradients are reduce-scattered (mean) before the
arithmetic, each device updates its share, the updates are all-gathered after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from muon_optax.adamw import adamw_hparams, adamw_leaf_update
from muon_optax.hparams import AdamWConfig, MuonConfig, Scalar, parse_groups
from muon_optax.labels import flat_labels, path_str
from muon_optax.layout import Stack, flat_dimension_numbers, matrix_leaf, plan_stacks
from muon_optax.muon import (
    MuonStackState,
    init_stack_state,
    leaf_update,
    muon_direction,
    muon_hparams,
)
from muon_optax.polar import after
from muon_optax.sharding import Collectives, adamw_shard_axis, pad_to, padded_shape, spec

SMALL_PARAM_THRESHOLD = 1024


class MuonAdamWState(NamedTuple):
    """State of :func:`muon_adamw`.

    ``mu``/``nu`` have the params' structure, with ``optax.MaskedNode()`` at Muon
    leaves; under ``axis_name`` a large AdamW parameter's moments are this device's
    slice. ``muon`` holds one :class:`MuonStackState` per stack (see ``stack_info``).
    """

    count: jax.Array                       # int32 steps taken
    mu: Any
    nu: Any
    muon: tuple[MuonStackState, ...]


@dataclasses.dataclass(frozen=True)
class AdamWLeaf:
    index: int
    path: str
    group: str
    shape: tuple[int, ...]
    axis: int | None            # split axis under ZeRO-2, None when replicated
    padded: tuple[int, ...]     # the (global) shape of its moments


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static layout of one params tree: which leaf goes where."""

    treedef: Any
    paths: tuple[str, ...]
    adamw: tuple[AdamWLeaf, ...]
    stacks: tuple[Stack, ...]


def _make_plan(params: Any, configs: Mapping[str, AdamWConfig | MuonConfig], param_labels: Any,
               dimension_numbers: Any, num_devices: int, threshold: int) -> Plan:
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = tuple(path_str(p) for p, _ in leaves_with_path)
    leaves = [x for _, x in leaves_with_path]
    for path, x in zip(paths, leaves):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"parameter {path!r} is a {type(x).__name__}, not an array.")
    labels = flat_labels(param_labels, params, paths, list(configs))
    dims = flat_dimension_numbers(dimension_numbers, params)
    adamw_leaves, matrices = [], []
    for i, (path, x, label) in enumerate(zip(paths, leaves, labels)):
        if isinstance(configs[label], MuonConfig):
            matrices.append(matrix_leaf(i, path, x, label, dims[i]))
        else:
            shape = tuple(x.shape)
            axis = adamw_shard_axis(shape, num_devices, threshold)
            adamw_leaves.append(AdamWLeaf(i, path, label, shape, axis,
                                          padded_shape(shape, axis, num_devices)))
    return Plan(treedef, paths, tuple(adamw_leaves), plan_stacks(matrices, configs, num_devices))


def _local_shape(shape: tuple[int, ...], axis: int | None, n: int) -> tuple[int, ...]:
    return shape if axis is None else shape[:axis] + (shape[axis] // n,) + shape[axis + 1:]


def _slot_hparams(stack: Stack, hps: dict[str, dict[str, jax.Array]], comm: Collectives):
    """This device's per-matrix momentum, beta2 and orientation: scalars when uniform."""
    groups = stack.slot_values(lambda m: m.group)
    names = sorted(set(groups.tolist()))
    out = {}
    for k in ("momentum", "beta2"):
        if len(names) == 1:
            out[k] = hps[names[0]][k]
        else:  # a stack shared by groups: gather each slot's group value
            table = jnp.stack([hps[g][k] for g in names])
            out[k] = comm.local(table[np.searchsorted(names, groups)])[:, None, None]
    flags = stack.slot_values(lambda m: m.transposed)
    out["transposed"] = bool(flags[0]) if np.all(flags == flags[0]) else comm.local(flags)
    return out


def _adamw_step(plan, comm, configs, hps, t, g_leaves, p_leaves, state, updates):
    """AdamW leaves: fills ``updates``; returns the new ``(mu, nu)`` trees.

    Small params are all-reduced and updated everywhere; large ones are reduce-scattered
    along their split axis, updated as a slice with their slice of the moments, and the
    updates all-gathered back.
    """
    mu = plan.treedef.flatten_up_to(state.mu)
    nu = plan.treedef.flatten_up_to(state.nu)
    for a in plan.adamw:
        g, p = g_leaves[a.index], None if p_leaves is None else p_leaves[a.index]
        if a.axis is None:
            g = comm.mean(g)
        else:
            g = comm.mean_scatter(pad_to(g, a.padded), a.axis)
            p = None if p is None else comm.local(pad_to(p, a.padded), a.axis)
        u, mu[a.index], nu[a.index] = adamw_leaf_update(
            g, p, mu[a.index], nu[a.index], t, hps[a.group],
            cfg=configs[a.group])
        if a.axis is not None:
            u = comm.gather(u, a.axis)[tuple(slice(0, n) for n in a.shape)]
        updates[a.index] = u
    return plan.treedef.unflatten(mu), plan.treedef.unflatten(nu)


def _leaf_sum(stack: Stack, comm: Collectives):
    """``adaptive``'s sum over each leaf's matrices, for stacks holding a leaf of several.

    Maps the per-slot ``(K_local, 1, 1)`` values to each slot's leaf total: a segment sum
    over this device's slots, summed over the devices, read back per slot. None when
    every leaf is one matrix (then each slot is its own total).
    """
    if not stack.config.adaptive or all(m.batch == 1 for m in stack.members):
        return None
    _, seg = np.unique(stack.slot_values(lambda m: m.index), return_inverse=True)
    num = int(seg.max()) + 1

    def leaf_sum(d):
        local = comm.local(seg)
        totals = jax.ops.segment_sum(d[:, 0, 0], local, num_segments=num)
        if comm.active:
            totals = jax.lax.psum(totals, comm.axis_name)
        return totals[local][:, None, None]

    return leaf_sum


def _muon_step(plan, comm, hps, g_leaves, p_leaves, state, updates):
    """Muon stacks: fills ``updates``; returns the new stack states.

    Per stack: reduce-scatter the stacked gradients so each device holds the mean
    gradient of the matrices it owns, compute their directions, all-gather the
    directions. The cautious update is elementwise, so it runs per leaf in the leaf's
    own layout and no stacked copy of the params is ever made. A stack's arithmetic
    starts once the previous stack's directions are done (only one stack's temporaries
    are alive at a time); its collectives are not held back, so XLA may still overlap
    them with another stack's math.
    """
    new_states, o = [], None
    for stack, st in zip(plan.stacks, state.muon):
        # One stack at a time: its temporaries die before the next stack's are made.
        # Unsharded, the stacking copy waits too; sharded, only the arithmetic waits,
        # so the collective may overlap the previous stack's math.
        leaves = [g_leaves[m.index] for m in stack.members]
        if not comm.active:
            leaves = [after(x, o) for x in leaves]
        g = after(comm.mean_scatter(stack.stack(leaves), 0), o if comm.active else None)
        o, st = muon_direction(g, st, cfg=stack.config, count=state.count,
                               leaf_sum=_leaf_sum(stack, comm),
                               **_slot_hparams(stack, hps, comm))
        new_states.append(st)
        for m, o_leaf in zip(stack.members, stack.unstack(comm.gather(o, 0))):
            hp = hps[m.group]
            updates[m.index] = leaf_update(o_leaf, p_leaves[m.index], hp["lr"],
                                           hp["weight_decay"], rows=m.rows, cols=m.cols,
                                           cfg=stack.config)
    return tuple(new_states)


def build(
    configs: Mapping[str, AdamWConfig | MuonConfig],
    param_labels: Any,
    *,
    dimension_numbers: Any = None,
    axis_name: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    small_param_threshold: int = SMALL_PARAM_THRESHOLD,
) -> optax.GradientTransformation:
    """The engine behind :func:`muon_adamw`, :func:`muon_optax.muon` and ``adamw``."""

    def plan_for(params: Any, num_devices: int) -> Plan:
        return _make_plan(params, configs, param_labels, dimension_numbers, num_devices,
                          small_param_threshold)

    def init_fn(params):
        comm = Collectives(axis_name, grads_reduced=mesh is not None)
        plan = plan_for(params, comm.size)
        leaves = plan.treedef.flatten_up_to(params)
        mu, nu = [optax.MaskedNode()] * len(leaves), [optax.MaskedNode()] * len(leaves)
        for a in plan.adamw:
            shape, dtype = _local_shape(a.padded, a.axis, comm.size), leaves[a.index].dtype
            mu_dtype = configs[a.group].mu_dtype
            mu[a.index] = jnp.zeros(shape, dtype if mu_dtype is None else mu_dtype)
            nu[a.index] = jnp.zeros(shape, dtype)
        muon = tuple(init_stack_state(s.padded // comm.size, s.rows, s.cols, s.dtype,
                                      s.reduces_rows, s.config) for s in plan.stacks)
        return MuonAdamWState(jnp.zeros([], jnp.int32), plan.treedef.unflatten(mu),
                              plan.treedef.unflatten(nu), muon)

    def update_fn(grads, state, params=None):
        needs_params = any(isinstance(c, MuonConfig) or c.needs_params()
                           for c in configs.values())
        if params is None and needs_params:
            raise ValueError("muon_adamw: update needs the params (Muon's cautious weight "
                             "decay and AdamW's weight decay read them): call "
                             "tx.update(grads, state, params).")
        reference = grads if params is None else params
        if params is not None and jax.tree.structure(grads) != jax.tree.structure(params):
            raise ValueError("muon_adamw: grads and params differ in structure:\n"
                             f"grads:  {jax.tree.structure(grads)}\n"
                             f"params: {jax.tree.structure(params)}")
        comm = Collectives(axis_name, grads_reduced=mesh is not None)
        plan = plan_for(reference, comm.size)
        g_leaves = plan.treedef.flatten_up_to(grads)
        p_leaves = plan.treedef.flatten_up_to(params) if params is not None else None
        for path, g, x in zip(plan.paths, g_leaves, p_leaves or g_leaves):
            if tuple(g.shape) != tuple(x.shape):
                raise ValueError(f"muon_adamw: the gradient of {path!r} has shape {g.shape}"
                                 f" but the parameter has shape {x.shape}.")
        if len(state.muon) != len(plan.stacks):
            raise ValueError("muon_adamw: the state was made for other params (its Muon "
                             "stacks differ); call tx.init on these params.")

        count = state.count
        hps = {name: (adamw_hparams(c, count) if isinstance(c, AdamWConfig)
                      else muon_hparams(c, count)) for name, c in configs.items()}
        updates = [None] * len(g_leaves)
        mu, nu = _adamw_step(plan, comm, configs, hps, count + 1, g_leaves, p_leaves, state,
                             updates)
        muon = _muon_step(plan, comm, hps, g_leaves, p_leaves, state, updates)
        new_state = MuonAdamWState(optax.safe_int32_increment(count), mu, nu, muon)
        return plan.treedef.unflatten(updates), new_state

    def state_specs(params: Any, mesh: jax.sharding.Mesh) -> MuonAdamWState:
        if axis_name is None:
            raise ValueError("state_specs: this transformation was built without "
                             "axis_name; pass axis_name='data' (your mesh axis) to shard it.")
        if axis_name not in mesh.shape:
            raise ValueError(f"state_specs: the mesh has axes {tuple(mesh.shape)}, not "
                             f"{axis_name!r}.")
        plan = plan_for(params, mesh.shape[axis_name])
        moments = [optax.MaskedNode()] * len(plan.paths)
        for a in plan.adamw:
            moments[a.index] = spec(a.axis, axis_name)
        tree = plan.treedef.unflatten(moments)
        stacked = MuonStackState(spec(0, axis_name), spec(0, axis_name))
        return MuonAdamWState(spec(None, axis_name), tree, tree,
                              tuple(stacked for _ in plan.stacks))

    def stack_info(params: Any, num_devices: int = 1) -> list[dict[str, Any]]:
        """Which matrices each stack holds, for inspection and the benchmarks."""
        plan = plan_for(params, num_devices)
        return [dict(shape=(s.rows, s.cols), dtype=str(s.dtype), size=s.size,
                     padded=s.padded, members=[m.path for m in s.members])
                for s in plan.stacks]

    if mesh is not None:
        init_fn, update_fn = _wrap_in_shard_map(init_fn, update_fn, state_specs, mesh)
    return optax.GradientTransformation(_Init(init_fn, state_specs, stack_info), update_fn)


def _wrap_in_shard_map(init_fn, update_fn, state_specs, mesh):
    """For plain ``jax.jit`` users: init and update run their own ``shard_map``.

    The gradients come in replicated (already averaged by XLA); each device takes the
    share it owns, updates it with its shard of the state, and all-gathers the updates.
    The state lives sharded over the mesh axis, as in the explicit ZeRO-2 form.
    """
    P = jax.sharding.PartitionSpec

    def init(params):
        specs = state_specs(params, mesh)
        return jax.shard_map(init_fn, mesh=mesh, in_specs=P(), out_specs=specs)(params)

    def update(grads, state, params=None):
        specs = state_specs(params if params is not None else grads, mesh)
        return jax.shard_map(update_fn, mesh=mesh, in_specs=(P(), specs, P()),
                             out_specs=(P(), specs))(grads, state, params)

    return init, update


class _Init:
    """``tx.init``, carrying what :func:`muon_optax.state_specs` needs to know."""

    def __init__(self, fn: Callable, state_specs: Callable, stack_info: Callable):
        self._fn, self.state_specs, self.stack_info = fn, state_specs, stack_info

    def __call__(self, params: Any) -> MuonAdamWState:
        return self._fn(params)


def muon_adamw(
    groups: Mapping[str, Mapping[str, Any]],
    param_labels: Any,
    *,
    dimension_numbers: Any = None,
    axis_name: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    small_param_threshold: int = SMALL_PARAM_THRESHOLD,
) -> optax.GradientTransformation:
    """nanochat's MuonAdamW: AdamW and Muon parameter groups in one transformation.

    Args:
      groups: group name -> a dict in nanochat's ``param_groups`` format without
        ``params``: ``dict(kind="adamw", lr, betas, eps, weight_decay)`` or
        ``dict(kind="muon", lr, momentum, ns_steps, beta2, weight_decay)``; Muon groups
        also take ``row_equilibration`` (default True), ``renormalize`` (default True),
        ``compute_dtype``, ``polar_method``, ``ns_coeffs`` ("polar_express"),
        ``nesterov`` (True), ``normuon`` (True), ``cautious`` (True),
        ``preconditioning`` ("basin") and ``mu_dtype`` (None) (see
        :func:`muon_optax.muon`). Every scalar may be an optax schedule of the step
        count.
      param_labels: the params' tree with a group name at every leaf, or a callable
        params -> such a tree (see :func:`muon_optax.label_by_path`).
      dimension_numbers: which axes of a Muon leaf are input (``reduction_axis``) and
        output (``output_axis``) axes, as ``optax.contrib.MuonDimensionNumbers``: one for
        all, a tree of them, or a callable. Default: the last two axes are ``(in, out)``
        (Flax layout), leading axes are batch axes (a scanned ``(L, in, out)`` stack is L
        matrices). PyTorch layout is ``MuonDimensionNumbers(reduction_axis=1,
        output_axis=0)``.
      axis_name: a mesh axis to shard over (ZeRO-2); then ``init`` and ``update`` run
        inside ``jax.shard_map`` and ``update`` takes each device's own, unreduced
        gradients. See :func:`muon_optax.state_specs`.
      mesh: with ``axis_name``, for plain ``jax.jit`` train steps (no ``shard_map`` of
        your own): ``init`` and ``update`` then wrap their own ``shard_map`` over
        ``mesh``, take the already averaged gradients, and keep the state sharded over
        ``axis_name``, each device orthogonalizing only the matrices it owns.
      small_param_threshold: under ``axis_name``, AdamW params with fewer elements are
        all-reduced and replicated instead of split.

    Returns:
      An ``optax.GradientTransformation`` with :class:`MuonAdamWState`. ``update``
      needs ``params``.
    """
    configs = parse_groups(groups)
    if axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a mesh axis name (str), got {axis_name!r}.")
    if mesh is not None and axis_name not in getattr(mesh, "shape", {}):
        raise ValueError(f"mesh= needs axis_name= naming one of its axes "
                         f"{tuple(getattr(mesh, 'shape', {}))}, got axis_name={axis_name!r}.")
    if isinstance(small_param_threshold, bool) or not isinstance(small_param_threshold, int):
        raise TypeError("small_param_threshold must be an int (elements).")
    return build(configs, param_labels, dimension_numbers=dimension_numbers,
                 axis_name=axis_name, mesh=mesh, small_param_threshold=small_param_threshold)

def muon(
    lr: Scalar,
    momentum: Scalar = 0.95,
    ns_steps: int = 5,
    beta2: Scalar = 0.95,
    weight_decay: Scalar = 0.0,
    *,
    row_equilibration: bool = True,
    renormalize: bool = True,
    compute_dtype: Any = None,
    polar_method: str = "auto",
    dimension_numbers: Any = None,
    ns_coeffs: Any = "polar_express",
    nesterov: bool = True,
    normuon: bool = True,
    cautious: bool = True,
    preconditioning: str = "basin",
    mu_dtype: Any = None,
) -> optax.GradientTransformation:
    """Muon on every leaf (each must have two or more axes), as nanochat computes it.

    Same-shape matrices are stacked and updated by one batched program. Usable alone or
    inside ``optax.partition``; :func:`muon_optax.muon_adamw` runs the same arithmetic
    for its Muon groups.

    Args:
      lr: learning rate; a matrix with more rows than columns (out > in) gets
        ``lr * sqrt(out / in)``.
      momentum: Nesterov momentum coefficient.
      ns_steps: polar iterations (static): 1..5 with Polar Express.
      beta2: decay rate of NorMuon's factored second moment.
      weight_decay: cautious decoupled weight decay, multiplied by ``lr``.
      row_equilibration: MuonEq row scaling before the polar iteration.
      renormalize: Muon+ rescaling of the polar factor to Frobenius norm
        ``sqrt(min(R, C))``.
      compute_dtype: dtype of the polar iteration; default float32 on CPU, bfloat16 on
        accelerators.
      polar_method: ``"auto"`` (default) runs the last polar steps of a float32
        rectangular matrix in Gram space where that saves FLOPs (1.3x fewer for 4:1
        matrices; the same polynomial, rounded differently, within float32 accuracy of
        the rule); ``"direct"`` runs every step as the rule writes it; ``"gram"``
        forces the Gram-space form (see :func:`muon_optax.polar.polar_express`).
      dimension_numbers: ``MuonDimensionNumbers`` (or a tree of them, or a callable
        params -> tree); default: last two axes ``(in, out)``, leading axes batch.
      ns_coeffs: the polynomial of each iteration: ``"polar_express"`` (default; the
        first ``ns_steps`` of its five triples), ``"quintic"`` (Keller Jordan's
        ``(3.4445, -4.7750, 2.0315)`` every step; then ``ns_steps`` may exceed 5), a
        triple ``(a, b, c)`` (every step), or an ``(n, 3)`` table (its first
        ``ns_steps`` rows; ``n >= ns_steps``).
      nesterov: Nesterov momentum ``lerp(g, buf, momentum)`` (default); False: the
        buffer itself.
      normuon: NorMuon's variance reduction (default on).
      cautious: weight decay only where the update and the weight agree in sign
        (default); False: plain decoupled decay ``-lr_eff wd P``.
      preconditioning: ``"basin"`` (default: ``X / (1.01 ||X||_F + 1e-6)``, after
        MuonEq) or ``"aol"`` (Turbo-Muon's row scaling folded into the first iteration;
        it may allow one iteration fewer); also optax's ``"frobenius"``,
        ``"spectral"``, ``"schatten"``.
      mu_dtype: dtype of the momentum buffer (default: the parameter's).

    Returns:
      An ``optax.GradientTransformation``; ``update`` needs ``params``.
    """
    cfg = MuonConfig.make(lr, momentum, ns_steps, beta2, weight_decay, row_equilibration,
                          renormalize, compute_dtype, polar_method, ns_coeffs=ns_coeffs,
                          nesterov=nesterov, normuon=normuon, cautious=cautious,
                          preconditioning=preconditioning, mu_dtype=mu_dtype, where="muon")
    return build({"muon": cfg}, lambda params: jax.tree.map(lambda _: "muon", params),
                 dimension_numbers=dimension_numbers)


def adamw(
    lr: Scalar,
    betas: tuple[Scalar, Scalar] = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0,
) -> optax.GradientTransformation:
    """AdamW on every leaf, with nanochat's hyperparameter names.

    Usable alone or inside ``optax.partition``; :func:`muon_optax.muon_adamw` runs the
    same arithmetic for its AdamW groups. Each scalar may be an optax schedule.

    Args:
      lr: learning rate.
      betas: ``(b1, b2)``, the decay rates of the first and second moments.
      eps: added to the root of the second moment.
      weight_decay: decoupled decay, multiplied by ``lr``; needs ``params`` in ``update``.

    Returns:
      An ``optax.GradientTransformation`` whose state is ``MuonAdamWState``.
    """
    cfg = AdamWConfig.make(lr, betas, eps, weight_decay, where="adamw")
    return build({"adamw": cfg}, lambda params: jax.tree.map(lambda _: "adamw", params))
