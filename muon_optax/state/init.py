"""``tx.init``, carrying the options that ``state_specs``, ``describe``, ``estimate`` and the
portable state read; in an optax wrapper it answers ``state/wrapped.py``'s search."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from muon_optax.plan.plan import TreePlan
from muon_optax.state.wrapped import RECORDER
from muon_optax.step.engine import Options, tree_plan
from muon_optax.step.state import MuonAdamWState, state_partition_specs, state_shapes


class Init:
    """``tx.init`` with the transformation's options."""

    def __init__(self, fn: Callable, opts: Options):
        self._fn, self.options, self.configs = fn, opts, opts.configs

    def state_specs(self, params: Any, mesh: jax.sharding.Mesh) -> MuonAdamWState:
        """PartitionSpecs of the state of ``params`` on ``mesh`` (for ``shard_map``)."""
        opts = self.options
        if opts.axes is None:
            raise ValueError("state_specs: this transformation was built without "
                             "axis_name; pass axis_name='data' (your mesh axis) to shard it.")
        missing = [a for a in opts.axes if a not in mesh.shape]
        if missing:
            raise ValueError(f"state_specs: the mesh has axes {tuple(mesh.shape)}, not "
                             f"{missing[0]!r}.")
        plan = tree_plan(opts, params, tuple((a, mesh.shape[a]) for a in opts.axes))
        return state_partition_specs(plan, opts.axes, skipped=opts.skip_nonfinite)

    def __call__(self, params: Any) -> MuonAdamWState:
        record = RECORDER.get()
        if record is not None:   # muon_optax.state_specs looking inside a wrapper
            return record(self, params)
        return self._fn(params)

    def global_shapes(self, params: Any, mesh: jax.sharding.Mesh | None = None) -> MuonAdamWState:
        """The global state's shape structs on ``mesh`` (default: the options'; none: 1 device)."""
        mesh = self.options.mesh if mesh is None else mesh
        sizes = {} if mesh is None else dict(mesh.shape)
        axes = tuple((a, sizes[a]) for a in self.options.axes or () if a in sizes)
        return global_state_shapes(tree_plan(self.options, params, axes), params,
                                   self.options.skip_nonfinite)

    def plan(self, params: Any, num_devices: int | None = None, state: Any = None) -> TreePlan:
        """The static plan for ``num_devices`` along one owner axis, or the mesh's axes
        (``state``: one made for them, whose layout tells traced params' Auto layouts)."""
        return tree_plan(self.options, params, owner_axis_sizes(self.options, num_devices), state)

    def stack_info(self, params: Any, num_devices: int | None = None) -> list[dict[str, Any]]:
        """Which matrices each stack holds and who owns them (inspection, benchmarks)."""
        plan = self.plan(params, num_devices)   # padded: every device's slots, all devices
        return [dict(shape=(sp.stack.rows, sp.stack.cols), dtype=str(sp.stack.dtype),
                     size=sp.stack.size, transport=sp.transport, slots=sp.num_slots,
                     padded=sp.num_slots * plan.num_devices, counts=sp.counts.tolist(),
                     members=[m.path for m in sp.stack.members])
                for sp in plan.owner.stacks]


def global_state_shapes(plan: TreePlan, params: Any, skipped: bool = False) -> MuonAdamWState:
    """The shape structs of the global state of ``params`` under ``plan``."""
    return state_shapes(plan, plan.treedef.flatten_up_to(params), per_device=False, skipped=skipped)


def init_of(tx: Any, where: str, hint: str = "") -> Init:
    """The :class:`Init` of ``tx`` (built here), or an error saying what ``where`` needs."""
    init = getattr(tx, "init", None)
    if not isinstance(init, Init):
        raise TypeError(f"{where} needs the transformation from muon_optax.muon_adamw (or muon, "
                        f"adamw, contrib_muon) itself, not a chain or a wrapper around it{hint}.")
    return init


def owner_axis_sizes(opts: Options, num_devices: int | None) -> tuple[tuple[str, int], ...]:
    """The owner axes with their sizes, outside any mesh context."""
    if opts.axes is None:
        if num_devices not in (None, 1):
            raise ValueError(f"{opts.name}: this transformation was built without axis_name; "
                             "it runs on one device.")
        return ()
    if num_devices is not None:
        if len(opts.axes) == 1:
            return ((opts.axes[0], int(num_devices)),)
        if opts.mesh is None or num_devices != math.prod(opts.mesh.shape[a] for a in opts.axes):
            raise ValueError(f"{opts.name}: with several owner axes {opts.axes}, give the mesh "
                             "(mesh=) rather than a device count.")
    if opts.mesh is None:
        raise ValueError(f"{opts.name}: pass num_devices (this transformation runs inside "
                         "your own shard_map and does not know the mesh).")
    return tuple((a, opts.mesh.shape[a]) for a in opts.axes)
