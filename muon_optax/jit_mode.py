"""The plain ``jax.jit`` form (``mesh=``): the engine runs its own ``shard_map``.

Every leaf enters in its own layout (``in_specs`` from the params' layouts: their types
on Explicit mesh axes, ``param_specs``, or the placement seen at an eager ``init``: see
:func:`muon_optax.sharding.placed_specs`), the gradients already averaged by XLA; the
updates leave laid out like the params and the state stays split over the owner axes.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax.engine import (
    Options,
    TreePlan,
    _check_state,
    _check_structure,
    _local_init,
    _local_update,
    _needs_params,
    state_partition_specs,
    state_shapes,
    tree_plan,
)
from muon_optax.sharding import normalize_spec, to_partition_spec, typed_spec


def wrap_in_shard_map(opts: Options):
    """``(init, update)`` that run their own ``shard_map`` over ``opts.mesh``.

    (``check_vma=False``: a block that an all-to-all hands to all of its holders is the
    same on each, which jax's types cannot see.)
    """
    mesh, name = opts.mesh, opts.name
    axes = tuple((a, mesh.shape[a]) for a in opts.axes)

    def layouts(plan: TreePlan):
        return plan.treedef.unflatten([to_partition_spec(s) for s in plan.specs])

    explicit = jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)

    def moved(x, spec: P, path: str = "state"):
        """Explicit axes: a leaf typed with another layout (or none: unplaced) moves to
        ``spec`` first. Auto axes need nothing: XLA moves data to match ``in_specs``."""
        if not explicit:
            return x
        typed = typed_spec(x, path) or ((),) * len(x.shape)
        if to_partition_spec(typed) != to_partition_spec(normalize_spec(spec, len(x.shape),
                                                                        path)):
            x = jax.sharding.reshard(x, NamedSharding(mesh, spec))
        return x

    def placed(tree, plan: TreePlan):
        leaves = plan.treedef.flatten_up_to(tree)
        return plan.treedef.unflatten([moved(x, to_partition_spec(s), path) for x, s, path
                                       in zip(leaves, plan.specs, plan.paths)])

    def placed_state(state, sspecs):
        return jax.tree.map(moved, state, sspecs)

    def init(params):
        _outside_shard_map(name)
        plan = tree_plan(opts, params, axes)
        fn = functools.partial(_local_init, plan, opts)
        return jax.shard_map(fn, mesh=mesh, in_specs=(layouts(plan),), check_vma=False,
                             out_specs=state_partition_specs(plan, opts.axes))(
            placed(params, plan))

    def update(grads, state, params=None):
        _outside_shard_map(name)
        if params is None and _needs_params(opts):
            raise ValueError(f"{name}: update needs the params (Muon's cautious weight decay "
                             "and AdamW's weight decay read them): call "
                             "tx.update(grads, state, params).")
        _check_structure(grads, params, name)
        ref = params if params is not None else grads
        plan = tree_plan(opts, ref, axes)
        leaves = plan.treedef.flatten_up_to(ref)
        _check_state(plan, state, state_shapes(plan, [tuple(x.shape) for x in leaves],
                                               [x.dtype for x in leaves], per_device=False),
                     name)
        specs, sspecs = layouts(plan), state_partition_specs(plan, opts.axes)
        fn = functools.partial(_local_update, plan, opts)
        if params is None:
            return jax.shard_map(lambda g, s: fn(g, s, None), mesh=mesh, check_vma=False,
                                 in_specs=(specs, sspecs), out_specs=(specs, sspecs))(
                placed(grads, plan), placed_state(state, sspecs))
        return jax.shard_map(fn, mesh=mesh, in_specs=(specs, sspecs, specs), check_vma=False,
                             out_specs=(specs, sspecs))(
            placed(grads, plan), placed_state(state, sspecs), placed(params, plan))

    return init, update


def _outside_shard_map(name: str) -> None:
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    if manual:
        raise ValueError(f"{name}: this transformation was built with mesh= for plain jax.jit "
                         f"train steps, but is called inside a shard_map over {manual}; inside "
                         "your own shard_map build it without mesh= (axis_name only).")
