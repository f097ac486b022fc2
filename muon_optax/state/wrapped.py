"""Finding muon_optax's state inside optax wrappers and chains.

``optax.chain``, ``MultiSteps``, ``inject_hyperparams``, ``apply_if_finite``,
``masked``/``partition`` and the like keep the state of the transformations they wrap
as it is, somewhere in their own state, and expose nothing else. So the wrapper's
``init`` is traced abstractly (``jax.eval_shape``) while muon_optax's ``init`` answers
with placeholder arrays it remembers; where those arrays land in the wrapper's state is
where muon_optax's state is. Everything else in a wrapper's state (counters,
hyperparameters, accumulators) is the wrapper's own.
"""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

_RECORDER: contextvars.ContextVar = contextvars.ContextVar("muon_optax_recorder", default=None)


class Found(NamedTuple):
    """One muon_optax transformation inside a wrapper. Its state is a subtree of the
    wrapper's, so its leaves are ``start .. start + n`` of the wrapper state's leaves."""

    init: Any          # its ``Init`` (options, plan, state specs)
    params: Any        # the params it was given (a wrapper may mask some)
    treedef: Any       # its state's structure
    start: int
    n: int

    def part(self, state: Any) -> Any:
        """Its state, out of the wrapper's ``state``: the subtree itself where it is found
        (its static parts, such as the layout it was made for, are the state's own), else
        rebuilt from its leaves."""
        kind = type(jax.tree.unflatten(self.treedef, [None] * self.n))
        at = 0
        for sub in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind)):
            if isinstance(sub, kind) and at == self.start:
                return sub
            at += len(jax.tree.leaves(sub)) if isinstance(sub, kind) else 1
        leaves = jax.tree.leaves(state)[self.start:self.start + self.n]
        return jax.tree.unflatten(self.treedef, leaves)


class _Recorder:
    def __init__(self, shapes_of):
        self.shapes_of = shapes_of     # (init, params) -> the state's shape structs
        self.calls: list[tuple[Any, Any, Any]] = []

    def record(self, init: Any, params: Any) -> Any:
        state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                             self.shapes_of(init, params))
        self.calls.append((init, params, state))
        return state


def recorder() -> _Recorder | None:
    """The active recorder while :func:`locate` traces a wrapper's ``init``."""
    return _RECORDER.get()


def locate(tx: Any, params: Any, shapes_of) -> tuple[list[Found], Any]:
    """The muon_optax transformations inside ``tx`` and where their states lie, and the
    shape structs of ``tx``'s whole state.

    ``shapes_of(init, params)``: the shape structs each answers with (global shapes, say).
    """
    rec = _Recorder(shapes_of)
    token = _RECORDER.set(rec)
    found: list[Found] = []
    try:
        def traced(p):
            out = tx.init(p)
            where = {id(x): i for i, x in enumerate(jax.tree.leaves(out))}
            for init, seen, state in rec.calls:
                leaves, treedef = jax.tree.flatten(state)
                start = where.get(id(leaves[0]))
                if start is not None and all(where.get(id(x)) == start + i
                                             for i, x in enumerate(leaves)):
                    found.append(Found(init, jax.tree.map(_struct, seen), treedef, start,
                                       len(leaves)))
            return out
        shapes = jax.eval_shape(traced, params)
    finally:
        _RECORDER.reset(token)
    return found, shapes


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
