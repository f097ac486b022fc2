"""The optimizer's state: structure, shapes (:func:`state_shapes`), specs and fit checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from muon_optax.plan.plan import TreePlan
from muon_optax.plan.specs import split_spec, to_partition_spec
from muon_optax.plan.state_layout import StateLayout, layout_error, layout_of


class MuonBuffers(NamedTuple):
    """The Muon state of one state key's stacks: 1-D ``(N * L,)`` arrays split over the
    owner axes, ``d L .. (d + 1) L - 1`` device ``d``'s share (its matrices' momenta, resp.
    NorMuon second moments, stack by stack); on one device, one stack's. Not ``(N, L)``: a
    TPU tiles a ``(1, L)`` share, and writing a stack into it is a relayout slow to compile."""

    momentum: jax.Array
    second_moment: jax.Array


class MuonAdamWState(NamedTuple):
    """State of :func:`muon_optax.muon_adamw`.

    ``mu``/``nu`` have the params' structure, ``optax.MaskedNode()`` at Muon leaves; a large
    AdamW parameter's moments may be split over the owner axes (padded). ``muon``: one
    :class:`MuonBuffers` per parameter (and momentum) dtype, on one device per stack
    (:func:`muon_optax.export_state` gives it per parameter). ``skipped``: steps skipped for
    a non-finite gradient (int32; None unless ``skip_nonfinite=True``), not in ``count``.
    ``layout``: the :class:`StateLayout` the state was made for (a node without leaves, part
    of the structure): ``update`` refuses a state made for another."""

    count: jax.Array                       # int32 steps taken
    mu: Any
    nu: Any
    muon: tuple[MuonBuffers, ...]
    skipped: Any = None
    layout: StateLayout | None = None


def check_state(plan: TreePlan, state: Any, want: MuonAdamWState, name: str,
                 dtypes: Sequence[Any] = ()) -> None:
    """A state made for these params (``dtypes``: theirs) and layout, or a clear error."""
    other_layout = isinstance(state, MuonAdamWState) and state.layout != want.layout
    if other_layout:   # the leaves first: a shape or dtype says more than a layout
        needed, want = want.layout, want._replace(layout=state.layout)
    got_def, want_def = jax.tree.structure(state), jax.tree.structure(want)
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


def state_shapes(plan: TreePlan, leaves: Sequence[Any], per_device: bool,
                 skipped: bool = False) -> Any:
    """The state as shape structs, one device's (``per_device``) or global, for ``leaves``
    (a device's blocks, or global; arrays or structs); ``skipped``: it counts skipped steps."""
    mu, nu = [optax.MaskedNode()] * len(plan.paths), [optax.MaskedNode()] * len(plan.paths)
    for a in plan.adamw:
        shape = tuple(leaves[a.index].shape) if a.local else a.padded
        if not a.local and per_device and a.axis is not None:
            shape = shape[:a.axis] + (shape[a.axis] // plan.num_devices,) + shape[a.axis + 1:]
        mu[a.index] = jax.ShapeDtypeStruct(shape, a.mu_dtype or leaves[a.index].dtype)
        nu[a.index] = jax.ShapeDtypeStruct(shape, leaves[a.index].dtype)
    muon, rows = [], 1 if per_device else plan.num_devices
    for key in plan.state_keys:   # its momentum's and second moment's shapes
        if plan.per_stack_state:   # one device: the stack's own, chunks need no relayout
            (sp,) = [sp for sp in plan.owner.stacks if sp.state_key == key]
            st = sp.stack
            shapes = [(st.size, st.rows, st.cols), (st.size,) + sp.second_shape]
        else:   # 1-D (MuonBuffers)
            shapes = [(rows * c[key].length,) for c in (plan.owner.momentum, plan.owner.second)]
        muon.append(MuonBuffers(*map(jax.ShapeDtypeStruct, shapes, (key[1], key[0]))))
    count = jax.ShapeDtypeStruct((), jnp.int32)
    return MuonAdamWState(count, plan.treedef.unflatten(mu), plan.treedef.unflatten(nu),
                          tuple(muon), count if skipped else None, layout_of(plan))


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
