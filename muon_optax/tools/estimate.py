"""What the optimizer costs per device, from shapes alone (no devices needed), like
DeepSpeed's memory estimators; from the static plan, so they are the compiled program's."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import optax

from muon_optax.params.labels import path_str
from muon_optax.plan.plan import executed_flops, make_tree_plan, matrix_flops
from muon_optax.plan.specs import check_spec, given_specs
from muon_optax.state.init import init_of
from muon_optax.step.engine import adamw_cost
from muon_optax.step.guard import stats_cost
from muon_optax.step.jit_mode import entry_cost
from muon_optax.step.sharded import muon_cost
from muon_optax.step.state import state_shapes
from muon_optax.step.transport import Transports


def estimate(tx: optax.GradientTransformation, params: Any, num_devices: int, *,
             param_specs: Any = None) -> dict[str, Any]:
    """Per-device optimizer costs of ``tx`` on ``num_devices`` devices along its owner axis.

    Args:
      tx: a transformation from :func:`muon_optax.muon_adamw` (or ``muon``/``adamw``) built
        with ``axis_name`` (and ``mesh`` for plain jit).
      params: the params, as arrays or ``jax.ShapeDtypeStruct``s.
      num_devices: the device count to plan for (any, e.g. 256).
      param_specs: the params' ``PartitionSpec``s over the owner axis (FSDP, ...);
        default: whole on every device (ZeRO-2).

    Returns:
      A dict of per-device lists (``num_devices`` numbers each): ``"state_bytes"`` (the state each
      device allocates, the longest share), ``"muon_flops"`` (its Muon FLOPs per step, the polar
      iteration in the direct form accelerators run in bfloat16: the owners' balancing cost) and
      ``"collective_bytes"`` (bytes it sends per step, ring algorithms). Also ``"program_flops"``:
      one device's compiled program on this backend (the sum of each piece's ``cost``), each
      conditional Muon slot counted as XLA's cost analysis does, plus the AdamW arithmetic; and
      ``"stacks"``: each stack's shape, matrices, transport, slots per device, FLOPs per matrix and
      members (path, matrices, blocks).
    """
    opts = init_of(tx, "estimate").options
    if opts.axes is None:
        raise ValueError("estimate: this transformation was built without axis_name (one device); "
                         "build it with axis_name='data' (and mesh= for plain jit) to estimate.")
    if len(opts.axes) != 1:
        raise ValueError(f"estimate: with several owner axes {opts.axes}, estimate one axis "
                         "of num_devices devices (build the transformation with one axis).")
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"estimate: num_devices must be a positive int, got {num_devices!r}.")
    axes = ((opts.axes[0], num_devices),)
    specs = None if param_specs is None else given_specs(param_specs, params, "estimate")
    for (p, x), s in zip(jax.tree_util.tree_flatten_with_path(params)[0], specs or ()):
        check_spec(s, x.shape, dict(axes), path_str(p))
    plan = make_tree_plan(params, opts.configs, opts.param_labels, opts.dimension_numbers,
                          axes, specs, opts.threshold, "estimate", opts.mesh is not None)
    # each leaf's layout as given (plan.specs: as the engine reads it, whole if it cuts blocks)
    given = specs or [((),) * len(s) for s in plan.specs]
    n, leaves, reduced = num_devices, jax.tree.leaves(params), opts.mesh is not None
    local = [jax.ShapeDtypeStruct(tuple(d // n if e else d for d, e in zip(x.shape, s)), x.dtype)
             for x, s in zip(leaves, plan.specs)]   # a device's blocks (one owner axis)
    state = state_shapes(plan, local, per_device=True, skipped=opts.skip_nonfinite)
    state_bytes = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize
                      for s in jax.tree.leaves(state))
    cost = (adamw_cost(plan, local, reduced) + Transports.cost(plan.owner, reduced)
            + muon_cost(plan) + entry_cost(plan, given, leaves)
            + stats_cost(plan, given, reduced, opts.max_grad_norm is not None
                         or opts.skip_nonfinite))
    return {
        "state_bytes": [state_bytes] * n,
        "muon_flops": plan.owner.device_flops(matrix_flops),
        "collective_bytes": [cost.sent] * n, "program_flops": cost.flops,
        "stacks": [dict(shape=(sp.stack.rows, sp.stack.cols), matrices=sp.stack.size,
                        transport=sp.transport, slots=sp.num_slots,
                        flops_per_matrix=executed_flops(sp.stack),
                        members=[dict(path=m.path, matrices=m.batch, blocks=m.blocks)
                                 for m in sp.stack.members])
                   for sp in plan.owner.stacks],
    }
