"""Who owns which Muon matrix, and where its pieces live. Each matrix has one *owner* among
the ``N`` devices of the owner axes, which holds its state and runs its polar iteration,
balanced by cost (:func:`assign_owners`). Every device runs the same program, so uneven
ownership lives in data: a device's share of a flat buffer (a *channel*) lists its matrices
stack by stack, at offsets read from static tables indexed by the device."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.params import layout
from muon_optax.params.dimension_numbers import check_unused
from muon_optax.params.labels import flat_labels, path_str
from muon_optax.plan.owners import assign_owners, slots_from_owners
from muon_optax.plan.routes import EXCHANGE, GATHER, LOCAL, Route, classify, local_holders
from muon_optax.plan.specs import Spec, adamw_shard_axis, padded_shape
from muon_optax.plan.warn import warn
from muon_optax.rule.hparams import AdamWConfig
from muon_optax.rule.polar import choose_method, default_compute_dtype, polar_flops

# Elementwise FLOPs per element of a Muon matrix around its polar iteration (cost model).
MUON_ELEMENTWISE_FLOPS = 30


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """A stack, how its matrices travel, and their owners. ``slots[d, j]``: the stack
    index of device ``d``'s ``j``-th owned matrix, ``-1`` past its count."""

    stack: layout.Stack
    transport: str
    routes: tuple[Route | None, ...]   # per member (``"exchange"`` only)
    owners: np.ndarray            # (K,)
    slots: np.ndarray             # (N, S)

    @property
    def route(self) -> Route | None:
        """The first member's: every member's pieces and blocks have its sizes."""
        return self.routes[0]

    def variants(self) -> tuple[list[int], np.ndarray]:
        """One member per distinct (route, matrix layout) of an ``"exchange"`` stack (an MLP's
        ``c_fc`` splits its rows, ``c_proj`` its columns), and each slot's variant, ``(N, S)``."""
        keys = [(r, tuple(m.shape[a] for a in m.matrix_axes), m.sides)
                for r, m in zip(self.routes, self.stack.members)]
        first = [keys.index(key) for key in keys]
        reps = sorted(set(first))
        variant = np.repeat([reps.index(i) for i in first], [m.batch for m in self.stack.members])
        return reps, variant[np.maximum(self.slots, 0)]

    @property
    def counts(self) -> np.ndarray:
        return (self.slots >= 0).sum(axis=1)

    @property
    def base(self) -> int:
        """Slots every device owns: run as one batched program."""
        return int(self.counts.min()) if self.slots.size else 0

    @property
    def num_slots(self) -> int:
        return self.slots.shape[1]

    def slot_of(self) -> np.ndarray:
        """Each matrix's slot on its owner."""
        out = np.zeros(self.stack.size, np.int64)
        d, j = np.nonzero(self.slots >= 0)
        out[self.slots[d, j]] = j
        return out

    @property
    def second_shape(self) -> tuple[int, int]:
        """One matrix's stored NorMuon second moment: a row or a column (one unused
        element without NorMuon)."""
        st = self.stack
        if not st.config.normuon:
            return (1, 1)
        return (1, st.cols) if st.reduces_rows else (st.rows, 1)

    @property
    def second_size(self) -> int:
        return math.prod(self.second_shape)

    @property
    def state_key(self) -> tuple[Any, ...]:
        """``(parameter dtype, momentum dtype)``: stacks whose state shares buffers, so each
        device may own a different mix. On one device each stack keeps its own (plus its first
        leaf's index): a step copies a slice of a shared buffer it rewrites, not a whole one."""
        mu = self.stack.config.mu_dtype
        key = (self.stack.dtype, self.stack.dtype if mu is None else np.dtype(mu))
        return key + (self.stack.members[0].index,) if self.slots.shape[0] == 1 else key


@dataclasses.dataclass(frozen=True)
class Channel:
    """One flat per-device buffer: each stack's slots back to back. Stack ``k``'s start
    in device ``d``'s share is ``offsets[k, d]``, ``sizes[k]`` elements a slot; every
    device allocates ``length``, the longest share."""

    stacks: tuple[int, ...]
    offsets: np.ndarray           # (num stacks, N)
    sizes: tuple[int, ...]        # per stack (0 outside the channel)
    length: int


def matrix_flops(stack: layout.Stack, method: str = "direct") -> int:
    """Cost of one matrix of ``stack``: its polar iteration and elementwise math. The owner
    plan counts the direct form (accelerators' default), so it is the same on every backend."""
    return (polar_flops(stack.rows, stack.cols, stack.config.ns_steps, method)
            + MUON_ELEMENTWISE_FLOPS * stack.rows * stack.cols)


def executed_flops(stack: layout.Stack) -> int:
    """FLOPs one matrix of ``stack`` runs here: the polar form this backend's compute
    dtype selects (``polar_method="auto"``)."""
    cfg = stack.config
    dtype = cfg.compute_dtype or default_compute_dtype()
    return matrix_flops(stack, choose_method(stack.rows, stack.cols, cfg.ns_steps,
                                             cfg.polar_method, dtype))


@dataclasses.dataclass(frozen=True)
class OwnerPlan:
    """Owners, slots and channels of every Muon stack for ``num_devices`` devices."""

    num_devices: int
    stacks: tuple[StackPlan, ...]
    gather: dict[Any, Channel]       # grad dtype -> channel of the "gather" stacks
    exchange: dict[Any, Channel]     # grad dtype -> all-to-all pieces, towards owners
    back: dict[Any, Channel]         # grad dtype -> all-to-all blocks, back to holders
    momentum: dict[Any, Channel]     # state key -> momentum of the owned matrices
    second: dict[Any, Channel]       # state key -> their NorMuon second moments

    def device_flops(self, cost) -> list[float]:
        """Each device's Muon FLOPs, ``cost(stack)`` per matrix."""
        return sum((sp.counts * cost(sp.stack) for sp in self.stacks),
                   np.zeros(self.num_devices)).tolist()

    def program_flops(self) -> float:
        """Muon FLOPs in one device's program: every conditional slot counted, as
        XLA's cost analysis counts a conditional's branch."""
        return float(sum(sp.num_slots * executed_flops(sp.stack) for sp in self.stacks))


def _channels(stacks: tuple[StackPlan, ...], size_of,
              transport: str | None = None) -> dict[Any, Channel]:
    """One channel per grad dtype of the ``transport`` stacks (None: per ``state_key`` of
    all stacks), its stacks' slots back to back in every device's share, in stack order."""
    by_key: dict[Any, list[int]] = {}
    for k, sp in enumerate(stacks):
        if transport is None or sp.transport == transport:
            by_key.setdefault(sp.state_key if transport is None else sp.stack.dtype, []).append(k)
    channels = {}
    for key, members in by_key.items():
        offsets = np.zeros((len(stacks), stacks[0].slots.shape[0]), np.int64)
        sizes, used = [0] * len(stacks), np.zeros(stacks[0].slots.shape[0], np.int64)
        for k in members:
            sizes[k] = size_of(stacks[k])
            offsets[k] = used
            used = used + stacks[k].counts * sizes[k]
        channels[key] = Channel(tuple(members), offsets, tuple(sizes), int(used.max()))
    return channels


def make_owner_plan(stacks: Sequence[layout.Stack], transports: Sequence[str],
                    routes: Sequence[Sequence[Route | None]],
                    holders: Sequence[np.ndarray | None], num_devices: int) -> OwnerPlan:
    """Assigns owners across all stacks and lays out every channel. ``routes[k]``: each member's
    route (``"exchange"`` stacks); ``holders[k]`` pins a ``"local"`` stack's matrices there."""
    flops, state, fixed = [], [], []
    for stack, hold in zip(stacks, holders):
        # The state in the parameter dtype (the cost model only).
        s = stack.rows * stack.cols + (stack.cols if stack.reduces_rows else stack.rows)
        flops += [matrix_flops(stack)] * stack.size
        state += [s * np.dtype(stack.dtype).itemsize] * stack.size
        fixed += [-1] * stack.size if hold is None else hold.tolist()
    owners = assign_owners(flops, state, num_devices, fixed)
    per_stack = np.split(owners, np.cumsum([st.size for st in stacks])[:-1])
    plans = tuple(StackPlan(st, kind, tuple(r), own, slots_from_owners(own, num_devices))
                  for st, kind, r, own in zip(stacks, transports, routes, per_stack))
    return OwnerPlan(num_devices, plans,
                     gather=_channels(plans, lambda sp: sp.stack.rows * sp.stack.cols, GATHER),
                     exchange=_channels(plans, lambda sp: sp.route.piece, EXCHANGE),
                     back=_channels(plans, lambda sp: sp.route.block_size, EXCHANGE),
                     momentum=_channels(plans, lambda sp: sp.stack.rows * sp.stack.cols),
                     second=_channels(plans, lambda sp: sp.second_size))


@dataclasses.dataclass(frozen=True)
class AdamWLeaf:
    """An AdamW parameter: where its moments live. ``local``: split over the mesh by the
    user, and updated where it lies; else whole on every device, its moments split along
    ``axis`` over the owner axes (padded to ``padded``), or replicated (``axis=None``)."""

    index: int
    path: str
    group: str
    shape: tuple[int, ...]
    axis: int | None
    padded: tuple[int, ...]
    local: bool = False
    mu_dtype: Any = None          # the first moment's dtype (None: the parameter's)


@dataclasses.dataclass(frozen=True)
class TreePlan:
    """The static layout of one params tree: which leaf goes where, on which device."""

    treedef: Any
    paths: tuple[str, ...]
    specs: tuple[Spec, ...]                # per leaf, the layout the engine works with
    axes: tuple[tuple[str, int], ...]      # owner axes and their sizes
    adamw: tuple[AdamWLeaf, ...]
    muon: tuple[layout.MatrixLeaf, ...]
    owner: OwnerPlan
    # One device (no owner axes, or mesh= on one): Muon state per stack, (K, R, C) (one_device).
    per_stack_state: bool = False
    # mesh=: each leaf's layout as read from the placed params, recorded in the state.
    given: tuple[Spec, ...] | None = None

    @property
    def num_devices(self) -> int:
        return self.owner.num_devices

    @property
    def state_keys(self) -> tuple[tuple[Any, ...], ...]:
        """Each Muon state buffer pair's ``StackPlan.state_key``, in order."""
        return tuple(self.owner.momentum)


def _signature(transport: str, route: Route | None) -> tuple:
    """What else matrices must share to be batched: the transport, and for an exchange
    the sizes of its pieces and blocks (layouts may differ: see ``StackPlan.variants``)."""
    if transport != EXCHANGE:
        return (transport,)
    return (transport, route.piece, route.block_size, route.replicas * route.piece)


# mesh=: a param laid out whole keeps its AdamW moments whole on fewer owner devices (split,
# they and its gathered update hold more; docs/sharding.md). ZeRO-2 splits them on any count.
SPLIT_MOMENTS_MIN_DEVICES = 4


def make_tree_plan(params: Any, configs: dict[str, Any], param_labels: Any,
                   dimension_numbers: Any, axes: Sequence[tuple[str, int]],
                   specs: Sequence[Spec] | None, threshold: int, where: str,
                   jit_form: bool = False) -> TreePlan:
    """Everything static about ``params`` for ``axes`` (owner axes with their sizes);
    ``specs``: each leaf's layout over the mesh (``None``: all whole, as in ``shard_map``)."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = tuple(path_str(p) for p, _ in leaves_with_path)
    leaves = [x for _, x in leaves_with_path]
    for path, x in zip(paths, leaves):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{where}: parameter {path!r} is a {type(x).__name__}, not an array.")
        # The rule is for real params; jax would refuse integer ones in update, far from here.
        dtype = jnp.dtype(x.dtype)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(f"{where}: parameter {path!r} is complex ({dtype}); the rule is "
                            "defined for real params only (the gradient's imaginary part would "
                            "be dropped). Store it as two real params (real and imaginary parts), "
                            "or optimize it with another transformation (optax.multi_transform).")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{where}: parameter {path!r} is {dtype}, not a floating dtype: it "
                            "has no gradient to follow. Keep it out of the params tree (e.g. in "
                            "an nnx.Variable other than nnx.Param), or cast it to float32.")
    specs = list(specs) if specs is not None else [((),) * len(x.shape) for x in leaves]
    labels = flat_labels(param_labels, params, paths, list(configs))
    dims = layout.flat_dimension_numbers(dimension_numbers, params, paths, leaves)
    n = math.prod(size for _, size in axes)
    adamw_leaves, matrices, kinds = [], [], {}
    for i, (path, x, label) in enumerate(zip(paths, leaves, labels)):
        shape = tuple(x.shape)
        if not isinstance(configs[label], AdamWConfig):
            leaf = layout.matrix_leaf(i, path, x, label, dims[i])
            kinds[i], specs[i] = _muon_transport(leaf, specs[i], axes, where)
            # Stored long side last (``wide``), an MLP's two matrices share a stack: one program
            # (TPU: less kernel code). Exchange and local stacks only (transposed a chunk at a
            # time); ZeRO-2's and one device's stay as laid out (BENCHMARKS.md, "Means tried").
            matrices.append(dataclasses.replace(leaf, wide=kinds[i][0] in (EXCHANGE, LOCAL)))
            continue
        local = any(specs[i])   # split by the user: updated where it lies
        whole = local or (jit_form and n < SPLIT_MOMENTS_MIN_DEVICES)
        axis = None if whole else adamw_shard_axis(shape, n, threshold)
        adamw_leaves.append(AdamWLeaf(i, path, label, shape, axis, padded_shape(shape, axis, n),
                                      local, configs[label].mu_dtype))
    for a in adamw_leaves:   # after the Muon leaves', whose errors say more
        check_unused(dims[a.index], a.path, a.group)
    stacks = layout.plan_stacks(matrices, configs, lambda leaf: _signature(*kinds[leaf.index]))
    transports = [kinds[st.members[0].index][0] for st in stacks]
    holders = [None if kind != LOCAL else np.concatenate(
        [local_holders(m, m.view_spec(specs[m.index], dict(axes)), axes) for m in st.members])
        for st, kind in zip(stacks, transports)]
    routes = [[kinds[m.index][1] for m in st.members] for st in stacks]
    return TreePlan(treedef, paths, tuple(specs), tuple(axes), tuple(adamw_leaves),
                    tuple(matrices), make_owner_plan(stacks, transports, routes, holders, n))


def _muon_transport(leaf: layout.MatrixLeaf, spec: Spec, axes: Sequence[tuple[str, int]],
                    where: str) -> tuple[tuple[str, Route | None], Spec]:
    """How a Muon leaf travels, and the layout the engine will read it in."""
    names = tuple(name for name, _ in axes)
    foreign = [a for entry in spec for a in entry if a not in names]
    if foreign:
        raise ValueError(
            f"{where}: parameter {leaf.path!r} is split over mesh axis {foreign[0]!r}, which "
            f"is not an owner axis (axis_name={names}); Muon needs whole matrices: "
            f"add {foreign[0]!r} to axis_name, or do not split Muon params over it.")
    try:
        return classify(leaf, leaf.view_spec(spec, dict(axes)), axes), spec
    except NotImplementedError as e:
        used = tuple(dict.fromkeys(a for entry in spec for a in entry))
        hint = ""
        if used and len(used) < len(names):
            keep = used[0] if len(used) == 1 else used
            hint = (f" It is split over {keep!r} only: built with axis_name={keep!r} instead of "
                    f"{names!r}, its blocks would stay put (each device updating its own).")
        warn(f"{where}: parameter {leaf.path!r} is laid out as {spec}, and {e}; it is gathered "
             "whole on every device before the update (more traffic). Split its layer (or expert, "
             f"or block) axes over all of axis_name, or its matrix axes within blocks.{hint}")
        return (GATHER, None), ((),) * len(spec)
