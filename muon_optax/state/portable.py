"""Optimizer state that moves between device counts and sharding modes. The flat Muon
buffers depend on the device count, owner plan and params' layouts, and large AdamW moments
may be padded: :func:`export_state` gives the same numbers per parameter, in its layout, and
:func:`import_state` takes them back (pure functions of global arrays, eager or jitted)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax.params.layout import MatrixLeaf
from muon_optax.plan.plan import StackPlan, TreePlan
from muon_optax.plan.specs import to_partition_spec, typed_spec
from muon_optax.state.init import Init, global_state_shapes, init_of
from muon_optax.state.optax_state import export_optax_state, import_optax_state, is_optax_muon_state
from muon_optax.state.wrapped import locate
from muon_optax.step.collectives import pad_to
from muon_optax.step.rows import member_rows
from muon_optax.step.state import MuonAdamWState, MuonBuffers, check_state, state_partition_specs


def _plan(tx: Any, params: Any, num_devices: int | None, where: str, state: Any = None) -> TreePlan:
    init = init_of(tx, where, ": import the wrapped one's state into the wrapper's (e.g. "
                   "(optax.EmptyState(), state) for optax.chain(optax.clip(1.0), tx))")
    opts = init.options
    if opts.axes is None or opts.mesh is not None:
        num_devices = None
    elif num_devices is None:
        raise ValueError(f"{where}: this transformation runs inside your own shard_map and does "
                         "not know the device count: pass num_devices=.")
    return init.plan(params, num_devices, state)


def _explicit_mesh(tx: Any, trees: Any) -> Any:
    """The mesh, if any input's layout is in its type (Explicit axes), else None."""
    for x in jax.tree.leaves(trees):
        if typed_spec(x, "") is not None:
            return (tx.init.options.mesh or getattr(getattr(x, "sharding", None), "mesh", None)
                    or jax.typeof(x).sharding.mesh)
    return None


def _tree(plan: TreePlan, at: dict[int, Any]) -> Any:
    """The params' tree with ``at[i]`` at leaf ``i``, None elsewhere."""
    return plan.treedef.unflatten([at.get(i) for i in range(len(plan.paths))])


def _portable_specs(plan: TreePlan, skipped: bool) -> dict[str, Any]:
    """The portable form's layouts: each moment like its param (an AdamW moment split by
    the owner plan, and NorMuon's statistics, replicated); None where it has no leaf."""
    adamw = _tree(plan, {a.index: to_partition_spec(plan.specs[a.index]) if a.local else P()
                         for a in plan.adamw})
    out = {"count": P(), "mu": adamw, "nu": adamw,
           "momentum": _tree(plan, {m.index: to_partition_spec(plan.specs[m.index])
                                    for m in plan.muon}),
           "second_moment": _tree(plan, {m.index: P() for m in plan.muon})}
    if skipped:
        out["skipped"] = P()
    return out


def _second_shape(m: MatrixLeaf, sp: StackPlan) -> tuple[int, ...]:
    """Leaf-shaped NorMuon statistics: the averaged side's axes of length 1 (both sides,
    one unused number per matrix, without NorMuon); with blocks, the leaf's block view."""
    rows, cols = (m.in_axes, m.out_axes) if m.transposed else (m.out_axes, m.in_axes)  # stored
    averaged = (rows if sp.stack.reduces_rows else cols) if sp.stack.config.normuon else rows + cols
    return tuple(1 if a in averaged else n for a, n in enumerate(m.shape))


def _muon_leaves(plan: TreePlan, bufs: dict, kind: str) -> dict[int, jax.Array]:
    """Each Muon leaf's momentum (or second moment), leaf-shaped, from the flat buffers."""
    out, momentum = {}, kind == "momentum"
    for k, sp in enumerate(plan.owner.stacks):
        st, key = sp.stack, sp.state_key
        channel = (plan.owner.momentum if momentum else plan.owner.second)[key]
        size = st.rows * st.cols if momentum else sp.second_size
        buf = bufs[key][0 if momentum else 1].reshape(plan.num_devices, -1)
        for m, stored in zip(st.members, member_rows(buf, channel, k, sp, size)):
            if momentum:
                out[m.index] = m.from_stored(stored.reshape(m.batch, st.rows, st.cols)
                                             ).reshape(m.leaf_shape)
            else:
                stored = stored.reshape((m.batch,) + sp.second_shape)
                out[m.index] = m.from_stored(stored, _second_shape(m, sp))
    return out


def export_state(tx: optax.GradientTransformation, state: MuonAdamWState, params: Any,
                 *, num_devices: int | None = None, as_optax: bool = False) -> Any:
    """``tx``'s state as per-parameter arrays that do not depend on devices or mode.

    Args:
      tx: the transformation from :func:`muon_optax.muon_adamw` (or ``muon``/``adamw``),
        or a chain or wrapper holding one (its part of the state is exported).
      state: its state, as global arrays (what ``init``/``update`` return under jit).
      params: the params (arrays or shape structs) the state belongs to.
      num_devices: only for a transformation built with ``axis_name`` but no ``mesh``
        (inside your own ``shard_map``): the state's device count (default: read from it).
      as_optax: for a :func:`muon_optax.contrib_muon` (alone or wrapped), the state that
        ``optax.contrib.muon`` with its arguments, wrapped alike, would have (to go on in optax).

    Returns:
      The portable form (continues on any device count and mode exactly as if uninterrupted)::

        {"count": int32 scalar,
         "mu", "nu": AdamW moments (params' structure; None at Muon leaves),
         "momentum": Muon momentum (params' structure, leaf-shaped; None at AdamW leaves),
         "second_moment": NorMuon's, likewise, the averaged side's axes of length 1 (cut
                          into blocks: the block view, imported only with the same blocks),
         "skipped": int32 scalar, steps skipped as non-finite (only with skip_nonfinite)}
    """
    if as_optax:
        return export_optax_state(tx, state, params, num_devices=num_devices)
    if not isinstance(getattr(tx, "init", None), Init):   # a chain or wrapper: its one part
        # The structure only: any device count will do.
        (found,), _ = locate(tx, params, lambda init, seen: init.global_shapes(seen),
                             "export_state: found {} muon_optax transformations in this one; "
                             "pass the muon_optax transformation itself and its part of the state.")
        state, params = found.part(state), found.params
        tx = optax.GradientTransformation(found.init, None)
    opts = tx.init.options
    if num_devices is None and opts.mesh is None and opts.axes is not None:
        num_devices = _state_devices(tx, state, params)
    plan = _plan(tx, params, num_devices, "export_state", state)
    check_state(plan, state, global_state_shapes(plan, params, opts.skip_nonfinite), "export_state")
    mesh = _explicit_mesh(tx, (state, params))
    if mesh is None:
        return _export(plan, state)
    # Explicit axes: slicing sharded buffers needs XLA's freedom (auto axes); out as the params.
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                             _portable_specs(plan, state.skipped is not None),
                             is_leaf=lambda x: isinstance(x, P))
    return jax.sharding.auto_axes(lambda s: _export(plan, s), out_sharding=shardings)(state)


def _state_devices(tx: Any, state: MuonAdamWState, params: Any) -> int:
    """The device count a ZeRO-2 state was made for: its mesh's, else the smallest giving its
    Muon buffers their sizes, else 1 if it fits (AdamW only, traced: any count exports alike)."""
    axes = tx.init.options.axes
    for x in jax.tree.leaves(state):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if isinstance(x, jax.Array) and mesh is not None and not isinstance(x, jax.core.Tracer) \
                and all(a in mesh.shape for a in axes):
            return int(np.prod([mesh.shape[a] for a in axes]))
    if state.muon:
        sizes = [int(np.size(x)) for b in state.muon for x in b]
        for n in range(1, min(4096, sizes[0]) + 1):
            if sizes[0] % n == 0:
                plan = _plan(tx, params, n, "export_state")
                if sizes == [n * c[key].length for key in plan.state_keys
                             for c in (plan.owner.momentum, plan.owner.second)]:
                    return n
        raise ValueError("export_state: no device count up to 4096 lays out Muon buffers of "
                         f"sizes {sizes} for these params: the state was made for other params "
                         "or another optimizer; pass num_devices= if it is right.")
    try:
        plan = _plan(tx, params, 1, "export_state")
        check_state(plan, state, global_state_shapes(plan, params, tx.init.options.skip_nonfinite),
                    "export_state")
    except ValueError as e:
        raise ValueError("export_state: this state's device count cannot be read from it "
                         "(no Muon leaves, traced arrays): pass num_devices=.") from e
    return 1


def _export(plan: TreePlan, state: MuonAdamWState) -> dict[str, Any]:
    state_mu, state_nu = plan.treedef.flatten_up_to(state.mu), plan.treedef.flatten_up_to(state.nu)
    mu, nu = {}, {}
    for a in plan.adamw:
        crop = tuple(slice(0, n) for n in a.shape)
        mu[a.index], nu[a.index] = state_mu[a.index][crop], state_nu[a.index][crop]
    bufs = dict(zip(plan.state_keys, state.muon))
    out = {"count": state.count, "mu": _tree(plan, mu), "nu": _tree(plan, nu),
           "momentum": _tree(plan, _muon_leaves(plan, bufs, "momentum")),
           "second_moment": _tree(plan, _muon_leaves(plan, bufs, "second"))}
    if state.skipped is not None:
        out["skipped"] = state.skipped
    return out


def _flat_buffer(plan: TreePlan, key: Any, leaves: list[Any], kind: str,
                 shape: tuple[int, ...]) -> jax.Array:
    """One state key's device-major ``(N * L,)`` buffer, in ``shape``, from leaf-shaped arrays."""
    momentum = kind == "momentum"
    channel = (plan.owner.momentum if momentum else plan.owner.second)[key]
    dt = key[1] if momentum else key[0]
    rows: list[list[jax.Array]] = [[] for _ in range(plan.num_devices)]
    for k in channel.stacks:
        sp = plan.owner.stacks[k]
        stored = []
        for m in sp.stack.members:
            x = jnp.asarray(leaves[m.index], dt)
            x = m.to_stored(m.view(x)) if momentum else jnp.transpose(x, m.stored_perm)
            stored.append(x.reshape(m.batch, -1))
        stored = jnp.concatenate(stored)
        for d, row in enumerate(rows):
            mine = sp.slots[d][sp.slots[d] >= 0]
            if len(mine):
                row.append(stored[np.asarray(mine)].reshape(-1))
    fill = [channel.length - sum(x.shape[0] for x in r) for r in rows]   # zeros at the end
    return jnp.stack([jnp.concatenate(r + [jnp.zeros(f, dt)]) for r, f in zip(rows, fill)]
                     ).reshape(-1).reshape(shape)


def import_state(tx: optax.GradientTransformation, portable: dict[str, Any], params: Any,
                 *, num_devices: int | None = None) -> MuonAdamWState:
    """``tx``'s state, as global arrays, from :func:`export_state`'s portable form.

    Place the result with :func:`muon_optax.state_specs` (or let ``jax.jit`` place it).
    ``num_devices``: for a transformation built with ``axis_name`` but no ``mesh``, the device
    count to make the state for (required there). ``portable`` may also be
    ``optax.contrib.muon``'s state (alone or wrapped) for ``tx`` a :func:`muon_optax.contrib_muon`
    with the same arguments, wrapped the same way (``state/optax_state.py``).
    """
    if any(map(is_optax_muon_state, jax.tree.leaves(portable, is_leaf=is_optax_muon_state))):
        return import_optax_state(tx, portable, params, num_devices=num_devices)
    plan = _plan(tx, params, num_devices, "import_state")
    _check_portable(plan, portable, params)
    # Arrays on other devices than tx's (exported on 3 devices, imported for 5) would keep
    # the state there, where the step cannot take it: compute from host copies instead.
    target = tx.init.options.mesh
    portable = jax.tree.map(lambda x: np.asarray(x) if _elsewhere(x, target) else x, portable)
    mesh = _explicit_mesh(tx, (portable, params))
    skipped = tx.init.options.skip_nonfinite
    specs = state_partition_specs(plan, tx.init.options.axes, skipped)
    if mesh is None:
        state = _import(plan, portable, params, skipped)
        if target is None or any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
            return state
        return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(target, spec)),
                            state, specs)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                             is_leaf=lambda x: isinstance(x, P))
    return jax.sharding.auto_axes(lambda p: _import(plan, p, params, skipped),
                                  out_sharding=shardings)(portable)


def _elsewhere(x: Any, mesh: jax.sharding.Mesh | None) -> bool:
    """A concrete array committed to devices outside ``mesh`` (any device: no mesh)."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) \
            or not getattr(x, "committed", True):
        return False
    return mesh is None or not set(x.devices()) <= set(mesh.devices.flat)


def _import(plan: TreePlan, portable: dict[str, Any], params: Any, skipped: bool) -> MuonAdamWState:
    want, flat = global_state_shapes(plan, params), plan.treedef.flatten_up_to
    mu, nu = [optax.MaskedNode()] * len(plan.paths), [optax.MaskedNode()] * len(plan.paths)
    moments = [(mu, flat(portable["mu"]), flat(want.mu)), (nu, flat(portable["nu"]), flat(want.nu))]
    for a in plan.adamw:
        for out, given, w in moments:   # padded as the state holds it
            out[a.index] = pad_to(jnp.asarray(given[a.index], w[a.index].dtype), w[a.index].shape)
    momentum, second = flat(portable["momentum"]), flat(portable["second_moment"])
    muon = tuple(MuonBuffers(_flat_buffer(plan, key, momentum, "momentum", w.momentum.shape),
                             _flat_buffer(plan, key, second, "second", w.second_moment.shape))
                 for key, w in zip(plan.state_keys, want.muon))
    skips = jnp.asarray(portable.get("skipped", 0), jnp.int32) if skipped else None
    return MuonAdamWState(jnp.asarray(portable["count"], jnp.int32), plan.treedef.unflatten(mu),
                          plan.treedef.unflatten(nu), muon, skips, want.layout)


def _check_portable(plan: TreePlan, portable: Any, params: Any) -> None:
    """The portable state of these params and groups, or an error naming the first mismatch."""
    keys = {"count", "mu", "nu", "momentum", "second_moment"}
    if not isinstance(portable, dict) or not keys <= set(portable) <= keys | {"skipped"}:
        raise ValueError("import_state: expected the dict made by muon_optax.export_state "
                         f"with keys {sorted(keys)} (and 'skipped').")
    leaves = plan.treedef.flatten_up_to(params)
    muon = {m.index: (m, _second_shape(m, sp))   # each Muon leaf, its statistics' shape
            for sp in plan.owner.stacks for m in sp.stack.members}
    for name in ("mu", "nu", "momentum", "second_moment"):
        try:
            given = plan.treedef.flatten_up_to(portable[name])
        except (ValueError, TypeError) as e:
            raise ValueError(f"import_state: portable[{name!r}] does not have the params' "
                             "structure; was it exported for other params?") from e
        for i, (path, x, g) in enumerate(zip(plan.paths, leaves, given)):
            if (i in muon) != (name in ("momentum", "second_moment")):
                if g is not None:
                    raise ValueError(f"import_state: {name} of {path!r} is given, but the "
                                     "parameter is in another kind of group now: the groups "
                                     "or labels differ from the exported state's.")
                continue
            shape = muon[i][1] if name == "second_moment" else tuple(x.shape)
            if g is None or tuple(np.shape(g)) != shape:
                blocks = ""
                if name == "second_moment" and g is not None and \
                        math.prod(np.shape(g)) != math.prod(shape):
                    blocks = (" NorMuon's statistics are per block (MuonDimensionNumbers' "
                              "output_blocks/reduction_blocks): give this transformation the "
                              "dimension_numbers of the one that exported the state (here "
                              f"{muon[i][0].blocks} (output, reduction) blocks).")
                raise ValueError(f"import_state: {name} of {path!r} has shape "
                                 f"{None if g is None else tuple(np.shape(g))}, expected "
                                 f"{shape}: the portable state was exported for other params "
                                 f"or groups.{blocks}")
