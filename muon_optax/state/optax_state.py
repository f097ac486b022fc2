"""``optax.contrib.muon``'s state in and out of :func:`muon_optax.contrib_muon`'s. optax's
Muon is ``optax.partition`` of two chains; its state, with ``MaskedNode()`` at the other
side's leaves, is :func:`muon_optax.export_state`'s portable form under other names:

    PartitionState({"muon": MaskedState((MuonState(count, mu, ns_coeffs), EmptyState(),
                                          <decay>, <lr>)),
                    "adam": MaskedState((ScaleByAdamState(count, mu, nu), <decay>, <lr>))})

``<decay>``, ``<lr>``: ``EmptyState()``, or a schedule's count (Muon's ``<decay>`` in a
``MaskedState`` with ``weight_decay_mask``). What optax's state does not show is not checked
(``adaptive``, ``preconditioning``, ``beta``, ``eps``, ``consistent_rms``, the decay and Adam
numbers); ``skip_nonfinite``'s count has no place there (an export drops it, an import: 0).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from optax.transforms import MaskedNode, MaskedState, PartitionState

from muon_optax.params.labels import path_str
from muon_optax.state.wrapped import locate
from muon_optax.step.state import MuonAdamWState

# The groups contrib_muon builds: its Muon leaves with and without weight decay, and Adam.
MUON, MUON_NO_DECAY, ADAM = "muon", "muon_no_decay", "adam"


def is_optax_muon_state(x: Any) -> bool:
    """Whether ``x`` is the state of one ``optax.contrib.muon`` (its ``PartitionState``)."""
    return (isinstance(x, PartitionState) and isinstance(x.inner_states, dict)
            and sorted(x.inner_states) == ["adam", "muon"])


def _inner(tx: Any, params: Any, where: str) -> tuple[Any, Any, Any]:
    """``(tx, params)`` of the one contrib_muon in ``tx``, and the shapes of ``tx``'s state."""
    def shapes_of(init, seen):
        opts = init.options
        if opts.name != "contrib_muon" or not set(opts.configs) <= {MUON, MUON_NO_DECAY, ADAM}:
            raise TypeError(f"{where}: optax.contrib.muon's state belongs to "
                            "muon_optax.contrib_muon (its rule and groups); this is "
                            f"muon_optax.{opts.name}. Build the transformation with "
                            "muon_optax.contrib_muon and the optax run's arguments.")
        return init.global_shapes(seen)

    (found,), shapes = locate(tx, params, shapes_of,
                              f"{where}: found {{}} muon_optax transformations in tx; "
                              "optax.contrib.muon's state converts to and from exactly one "
                              "muon_optax.contrib_muon (alone, or in a chain or wrapper).")
    inner_params = params if found.init is getattr(tx, "init", None) else found.params
    return optax.GradientTransformation(found.init, None), inner_params, shapes


@functools.cache
def _decay_schedule() -> type:
    """The type of add_decayed_weights' schedule state (no public name), taken on first
    use: building it runs jax, which must wait for jax.distributed.initialize."""
    return type(optax.add_decayed_weights(lambda count: 0.0).init(None))


def _rest(tx: Any, count: Any) -> dict[str, tuple[tuple[str, Any], ...]]:
    """Each side's chain after the moments, as ``(the argument that decides it, state)``."""
    def counted(value: Any, state_type: Any) -> Any:
        return state_type(count=count) if callable(value) else optax.EmptyState()

    muon, adam = tx.init.configs[MUON], tx.init.configs[ADAM]
    decay = counted(muon.weight_decay, _decay_schedule())
    if MUON_NO_DECAY in tx.init.configs:
        decay = MaskedState(decay)
    return {"muon": (("scale_by_shape", optax.EmptyState()),
                     ("weight_decay, weight_decay_mask", decay),
                     ("learning_rate", counted(muon.lr, optax.ScaleByScheduleState))),
            "adam": (("adam_weight_decay", counted(adam.weight_decay, _decay_schedule())),
                     ("adam_learning_rate (or learning_rate)",
                      counted(adam.lr, optax.ScaleByScheduleState)))}


def _describe(state: Any) -> str:
    kinds = {optax.EmptyState: "a constant (EmptyState)", MaskedState: "masked (MaskedState)",
             optax.ScaleByScheduleState: "a schedule (ScaleByScheduleState)",
             _decay_schedule(): "a schedule (WeightDecaySchedule)"}
    text = kinds.get(type(state), type(state).__name__)
    if isinstance(state, MaskedState):
        text += f" of {_describe(state.inner_state)}"
    return text


def _check(tx: Any, state: PartitionState, where: str) -> None:
    """optax's state has ``tx``'s parts, one step count and ``tx``'s coefficients, or an error."""
    chains = {side: getattr(state.inner_states[side], "inner_state", None)
              for side in ("muon", "adam")}
    first = {"muon": optax.contrib.MuonState, "adam": optax.ScaleByAdamState}
    want = _rest(tx, jnp.int32(0))
    for side, chain in chains.items():
        if not (isinstance(state.inner_states[side], MaskedState) and isinstance(chain, tuple)
                and len(chain) == 1 + len(want[side]) and isinstance(chain[0], first[side])):
            raise ValueError(f"{where}: this PartitionState is not optax.contrib.muon's "
                             "(optax 0.2.8: a Muon chain of 4 states and an AdamW chain of 3).")
    counts = [(f"{type(chain[0]).__name__}.count", chain[0].count) for chain in chains.values()]
    for side, chain in chains.items():
        for (name, expected), given in zip(want[side], chain[1:]):
            if jax.tree.structure(given) != jax.tree.structure(expected):  # types included
                raise ValueError(
                    f"{where}: {name}: the optax run's state holds {_describe(given)} there, "
                    f"this contrib_muon {_describe(expected)}: pass the optax run's {name} "
                    "(a schedule's state counts its steps; a mask adds a MaskedState).")
            counts += [(f"{name} count", c) for c in jax.tree.leaves(given)]
    values = {name: int(c) for name, c in counts if not isinstance(c, jax.core.Tracer)}
    if len(set(values.values())) > 1:
        raise ValueError(f"{where}: the step counts in optax's state differ ({values}); "
                         "muon_optax keeps one count for all parameters. Was the state "
                         "assembled from several runs?")
    ns_coeffs = chains["muon"][0].ns_coeffs
    if isinstance(ns_coeffs, jax.core.Tracer):
        return
    have = np.asarray(ns_coeffs, np.float32)
    runs = np.asarray(tx.init.configs[MUON].coeffs, np.float32)
    if not ((have.shape == (3,) and (runs == have).all()) or np.array_equal(have, runs)):
        raise ValueError(f"{where}: the optax run's state holds ns_coeffs {have.tolist()}, "
                         f"but contrib_muon runs {runs.tolist()} (one row per "
                         "Newton-Schulz step): pass the optax run's ns_coeffs and ns_steps.")


def _side(tree: Any, treedef: Any, want: list[Any], paths: list[str], name: str, kind: str,
          where: str) -> list[Any]:
    """One moment of optax's state as a portable list: the leaf where ``want`` (export_state's
    leaves) has one, None where optax holds ``MaskedNode()``; an error if they disagree."""
    try:
        leaves = treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: optax's {name} does not have the params' structure; "
                         "was the state made for other params?") from e
    for path, x, w in zip(paths, leaves, want):
        if isinstance(x, MaskedNode) != (w is None):
            runs = "does not run" if isinstance(x, MaskedNode) else "runs"
            raise ValueError(
                f"{where}: the optax run {runs} {kind} on {path!r} (its {name} shows it), "
                "unlike this contrib_muon: pass the same muon_weight_dimension_numbers "
                "(None: the 2-D leaves are Muon's, the others Adam's).")
    return [None if isinstance(x, MaskedNode) else x for x in leaves]


def to_portable(tx: Any, state: PartitionState, params: Any, where: str) -> dict:
    """optax's state of ``tx``'s arguments as :func:`muon_optax.export_state`'s form."""
    from muon_optax.state.portable import export_state

    _check(tx, state, where)
    muon_state, adam_state = (state.inner_states[side].inner_state[0] for side in ("muon", "adam"))
    n = 1 if tx.init.options.axes is not None and tx.init.options.mesh is None else None
    want = jax.eval_shape(lambda s: export_state(tx, s, params, num_devices=n),
                          tx.init.global_shapes(params))
    treedef = jax.tree.structure(params)
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    sides = {"momentum": (muon_state.mu, "MuonState.mu", "Muon"),
             "mu": (adam_state.mu, "ScaleByAdamState.mu", "Adam"),
             "nu": (adam_state.nu, "ScaleByAdamState.nu", "Adam")}
    wants = {k: treedef.flatten_up_to(want[k]) for k in sides}
    given = {k: _side(tree, treedef, wants[k], paths, name, kind, where)
             for k, (tree, name, kind) in sides.items()}
    for k, (_, name, _) in sides.items():
        for path, w, g in zip(paths, wants[k], given[k]):
            if w is None or g is None:
                continue
            if tuple(np.shape(g)) != tuple(w.shape):
                raise ValueError(f"{where}: {name} of {path!r} has shape "
                                 f"{tuple(np.shape(g))}, expected {tuple(w.shape)}: the "
                                 "optax state was made for other params.")
            if jnp.dtype(g.dtype) != jnp.dtype(w.dtype):
                raise ValueError(f"{where}: {name} of {path!r} is {g.dtype} in the "
                                 f"optax run's state, {w.dtype} in contrib_muon's: pass the "
                                 "optax run's mu_dtype (None keeps the parameter's dtype).")
    portable = {k: treedef.unflatten(leaves) for k, leaves in given.items()}
    portable["count"] = muon_state.count
    # contrib_muon has no NorMuon: its second moment is a placeholder of zeros.
    portable["second_moment"] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                             want["second_moment"])
    return portable


def _one(tree: Any, is_part: Any, what: str, where: str) -> tuple[Any, Any]:
    """The one part of ``tree`` where ``is_part`` holds, and ``put(new)``: ``tree`` with it."""
    parts = [x for x in jax.tree.leaves(tree, is_leaf=is_part) if is_part(x)]
    if len(parts) != 1:
        raise ValueError(f"{where}: found {len(parts)} {what} in the state; exactly one converts.")
    return parts[0], lambda new: jax.tree.map(lambda x: new if is_part(x) else x, tree,
                                              is_leaf=is_part)


def import_optax_state(tx: optax.GradientTransformation, optax_state: Any, params: Any,
                       *, num_devices: int | None = None) -> Any:
    """``tx``'s state (a :func:`muon_optax.contrib_muon`, alone or wrapped as the optax one
    was) from ``optax.contrib.muon``'s with the same arguments, the wrappers' own state kept."""
    from muon_optax.state.portable import import_state

    where = "import_state"
    inner, inner_params, want = _inner(tx, params, where)
    part, put = _one(optax_state, is_optax_muon_state, "optax.contrib.muon states", where)
    theirs_around = jax.tree.structure(put("muon"))
    _, put_ours = _one(want, lambda x: isinstance(x, MuonAdamWState), "muon_optax states", where)
    ours_around = jax.tree.structure(put_ours("muon"))
    if theirs_around != ours_around:
        raise ValueError(f"{where}: the wrappers around optax.contrib.muon's state "
                         f"({theirs_around}, its state as *) are not tx's ({ours_around}). Wrap "
                         "contrib_muon as optax.contrib.muon was (the same chain, "
                         "inject_hyperparams with the same static_args).")
    portable = to_portable(inner, part, inner_params, where)
    return put(import_state(inner, portable, inner_params, num_devices=num_devices))


def export_optax_state(tx: optax.GradientTransformation, state: Any, params: Any, *,
                       num_devices: int | None = None) -> Any:
    """A contrib_muon state (alone or wrapped) as ``optax.contrib.muon``'s with its arguments."""
    from muon_optax.state.portable import export_state

    where = "export_state(as_optax=True)"
    inner, inner_params, _ = _inner(tx, params, where)
    part, put = _one(state, lambda x: isinstance(x, MuonAdamWState), "muon_optax states", where)
    portable = export_state(inner, part, inner_params, num_devices=num_devices)
    treedef, count = jax.tree.structure(inner_params), jnp.asarray(portable["count"], jnp.int32)

    def masked(tree: Any) -> Any:
        return treedef.unflatten([MaskedNode() if x is None else x
                                  for x in treedef.flatten_up_to(tree)])

    rows = np.asarray(inner.init.configs[MUON].coeffs, np.float32)
    ns_coeffs = jnp.asarray(rows[0] if (rows == rows[0]).all() else rows)  # a triple: (3,)
    rest = {side: tuple(kept for _, kept in parts) for side, parts in _rest(inner, count).items()}
    muon_chain = (optax.contrib.MuonState(count=count, mu=masked(portable["momentum"]),
                                          ns_coeffs=ns_coeffs),) + rest["muon"]
    adam_chain = (optax.ScaleByAdamState(count=count, mu=masked(portable["mu"]),
                                         nu=masked(portable["nu"])),) + rest["adam"]
    return put(PartitionState({"muon": MaskedState(muon_chain), "adam": MaskedState(adam_chain)}))
