"""Finding muon_optax's state inside optax wrappers and chains (``optax.chain``,
``MultiSteps``, ``inject_hyperparams``, ``masked``, ...), which keep the state they wrap
somewhere in theirs and expose nothing else: the wrapper's ``init`` is traced abstractly while
muon_optax's answers with placeholder arrays it remembers; where those land in the wrapper's
state is where muon_optax's state is."""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# While locate traces a wrapper's init: the function (init, params) -> placeholder state that
# each muon_optax init answers with (state/init.py); else None.
RECORDER: contextvars.ContextVar = contextvars.ContextVar("muon_optax_recorder", default=None)


class Found(NamedTuple):
    """One muon_optax transformation in a wrapper, its state the leaves ``start:start + n``."""

    init: Any          # its ``Init`` (options, plan, state specs)
    params: Any        # the params it was given (a wrapper may mask some)
    treedef: Any       # its state's structure
    start: int
    n: int

    def part(self, state: Any) -> Any:
        """Its state in the wrapper's: the subtree (with its layout) where found, else rebuilt."""
        kind = type(jax.tree.unflatten(self.treedef, [None] * self.n))
        at = 0
        for sub in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind)):
            if isinstance(sub, kind) and at == self.start:
                return sub
            at += len(jax.tree.leaves(sub)) if isinstance(sub, kind) else 1
        leaves = jax.tree.leaves(state)[self.start:self.start + self.n]
        return jax.tree.unflatten(self.treedef, leaves)


def locate(tx: Any, params: Any, shapes_of, one: str | None = None) -> tuple[list[Found], Any]:
    """The muon_optax transformations in ``tx``, where their states lie, and ``tx``'s state's
    shapes (``shapes_of(init, params)``: each one's); ``one``: the TypeError unless just one."""
    calls: list[tuple[Any, Any, Any]] = []
    def record(init: Any, seen: Any) -> Any:
        state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes_of(init, seen))
        calls.append((init, seen, state))
        return state
    token = RECORDER.set(record)
    found: list[Found] = []
    try:
        def traced(p):
            out = tx.init(p)
            where = {id(x): i for i, x in enumerate(jax.tree.leaves(out))}
            for init, seen, state in calls:
                leaves, treedef = jax.tree.flatten(state)
                start = where.get(id(leaves[0]))
                if start is not None and all(where.get(id(x)) == start + i
                                             for i, x in enumerate(leaves)):
                    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                        x.shape, x.dtype, sharding=getattr(x, "sharding", None)), seen)
                    found.append(Found(init, structs, treedef, start, len(leaves)))
            return out
        shapes = jax.eval_shape(traced, params)
    finally:
        RECORDER.reset(token)
    if one is not None and len(found) != 1:
        raise TypeError(one.format(len(found)))
    return found, shapes


def state_specs(tx: Any, params: Any, mesh: jax.sharding.Mesh) -> Any:
    """PartitionSpecs of ``tx``'s state for ``jax.shard_map``'s ``in_specs``/``out_specs``.

    ``tx``: a transformation from :func:`muon_optax.muon_adamw` (or ``muon``/``adamw``)
    built with ``axis_name``, or a chain or wrapper holding one (``optax.chain``,
    ``MultiSteps``, ``inject_hyperparams``, ``apply_if_finite``, ``masked``/``partition``),
    whose own state gets ``P()``. ``params``: the full params (arrays or shape structs).
    Sharded leaves get the owner axes on their split axis, the rest ``P()``::

        specs = muon_optax.state_specs(tx, params, mesh)
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    """
    specs_fn = getattr(tx.init, "state_specs", None)
    if specs_fn is not None:
        return specs_fn(params, mesh)
    found, shapes = locate(tx, params, lambda init, seen: init.global_shapes(seen, mesh))
    if not found:
        raise TypeError("state_specs: no muon_optax transformation (muon_adamw, muon, adamw, "
                        "contrib_muon) found in this one or in its state; for a plain optax "
                        "transformation under ZeRO-2 the state is replicated: P().")
    leaves, treedef = jax.tree.flatten(shapes)
    specs = [P()] * len(leaves)
    for f in found:
        specs[f.start:f.start + f.n] = jax.tree.leaves(
            f.init.state_specs(f.params, mesh), is_leaf=lambda x: isinstance(x, P))
    return jax.tree.unflatten(treedef, specs)
