"""The plain ``jax.jit`` form (``mesh=``): the engine in its own ``shard_map``, every leaf in
its own layout, the gradients averaged by XLA; the updates leave laid out like the params."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax.plan.plan import TreePlan
from muon_optax.plan.specs import normalize_spec, to_partition_spec, typed_spec
from muon_optax.step.collectives import Cost
from muon_optax.step.engine import Options, check_update_args, local_init, local_update, tree_plan
from muon_optax.step.guard import GradStats, global_stats
from muon_optax.step.state import check_state, state_partition_specs, state_shapes


def wrap_in_shard_map(opts: Options):
    """``(init, update)`` in their own ``shard_map`` over ``opts.mesh`` (``check_vma=False``:
    a block an all-to-all hands to all its holders is the same on each, unseen by types)."""
    mesh, name = opts.mesh, opts.name
    axes = tuple((a, mesh.shape[a]) for a in opts.axes)

    def layouts(plan: TreePlan):
        return plan.treedef.unflatten([to_partition_spec(s) for s in plan.specs])

    explicit = jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)
    skip = opts.skip_nonfinite

    def moved(x, spec: P, path: str = "state"):
        """Explicit axes: a leaf typed with another layout (or unplaced) moves to ``spec``
        first. Auto axes need nothing: XLA moves data to match ``in_specs``."""
        if not explicit:
            return x
        typed = typed_spec(x, path) or ((),) * len(x.shape)
        if to_partition_spec(typed) != to_partition_spec(normalize_spec(spec, len(x.shape), path)):
            x = jax.sharding.reshard(x, NamedSharding(mesh, spec))
        return x

    def placed(tree, plan: TreePlan):
        leaves = plan.treedef.flatten_up_to(tree)
        return plan.treedef.unflatten([moved(x, to_partition_spec(s), path) for x, s, path
                                       in zip(leaves, plan.specs, plan.paths)])

    def init(params):
        _outside_shard_map(name)
        plan = tree_plan(opts, params, axes)
        fn = functools.partial(local_init, plan, opts)
        # Jitted: run eagerly (nnx.Optimizer), a shard_map compiles op by op (hundreds of times).
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(layouts(plan),), check_vma=False,
                                     out_specs=state_partition_specs(plan, opts.axes, skip)))(
            placed(params, plan))

    def update(grads, state, params=None):
        _outside_shard_map(name)
        check_update_args(opts, grads, params)
        ref = params if params is not None else grads
        plan = tree_plan(opts, ref, axes, state)
        check_state(plan, state, state_shapes(plan, plan.treedef.flatten_up_to(ref),
                                               per_device=False, skipped=skip), name)
        specs, sspecs = layouts(plan), state_partition_specs(plan, opts.axes, skip)
        # Clipping and finiteness read the whole gradient: taken on the global arrays.
        stats = (global_stats(grads, opts.max_grad_norm, skip)
                 if opts.max_grad_norm is not None or skip else GradStats(None, None))
        # Traced hyperparameters enter as arguments: shard_map can't close over Explicit arrays.
        extras = (stats, _array_hparams(opts))
        extra_specs = jax.tree.map(lambda _: P(), extras)
        extras = jax.tree.map(moved, extras, extra_specs)

        def fn(g, s, p, ex):
            return local_update(plan, _with_arrays(opts, ex[1]), g, s, p, ex[0])

        g, s = placed(grads, plan), jax.tree.map(moved, state, sspecs)
        p, p_specs = (None, P()) if params is None else (placed(params, plan), specs)
        return jax.shard_map(fn, mesh=mesh, in_specs=(specs, sspecs, p_specs, extra_specs),
                             check_vma=False, out_specs=(specs, sspecs))(g, s, p, extras)

    return init, update


def entry_cost(plan: TreePlan, given: list, leaves: list) -> Cost:
    """Moving the leaves from their ``given`` layouts into ``plan.specs``: a leaf given split
    but read whole has its gradient and param all-gathered (``(g - 1) / g`` of each)."""
    sizes = dict(plan.axes)
    groups = [math.prod(sizes[a] for entry in spec for a in entry) for spec in given]
    return sum((Cost(2 * (g - 1) / g * (math.prod(x.shape) * x.dtype.itemsize))
                for g, used, x in zip(groups, plan.specs, leaves) if g > 1 and not any(used)),
               Cost())


def _array_hparams(opts: Options) -> dict[str, Any]:
    """Hyperparameters given as arrays (traced under ``optax.inject_hyperparams``):
    ``{group: {field: array}}``, ``max_grad_norm`` under ``""``."""
    out = {name: {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                  if isinstance(getattr(cfg, f.name), jax.Array)}
           for name, cfg in opts.configs.items()}
    out = {name: found for name, found in out.items() if found}
    if isinstance(opts.max_grad_norm, jax.Array):
        out[""] = {"max_grad_norm": opts.max_grad_norm}
    return out


def _with_arrays(opts: Options, arrays: dict[str, Any]) -> Options:
    """``opts`` with the arrays of :func:`_array_hparams` put back (inside shard_map)."""
    if not arrays:
        return opts
    configs = {name: dataclasses.replace(cfg, **arrays[name]) if name in arrays else cfg
               for name, cfg in opts.configs.items()}
    return dataclasses.replace(opts, configs=configs, **arrays.get("", {}))


def _outside_shard_map(name: str) -> None:
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    if manual:
        raise ValueError(f"{name}: this transformation was built with mesh= for plain jax.jit "
                         f"train steps, but is called inside a shard_map over {manual}; inside "
                         "your own shard_map build it without mesh= (axis_name only).")
