"""Flax NNX ``Variable`` boxes in the trees users pass, and ``nnx.Optimizer``'s state (whose
``tx.init`` sees ``nnx.Param`` boxes, ``tx.update`` plain arrays). Argument trees (labels,
dimension numbers, param specs) are read unboxed against the unboxed params, so boxed and
plain trees mix; params, gradients and states keep their form. Without ``flax.nnx``
imported no tree can hold a box, and nothing is done."""

from __future__ import annotations

import sys
from typing import Any

import jax


def unbox(tree: Any) -> Any:
    """``tree`` with every ``nnx.Variable`` replaced by the value it holds."""
    variable = getattr(sys.modules.get("flax.nnx"), "Variable", None)
    if variable is None or tree is None:
        return tree
    is_box = lambda x: isinstance(x, variable)  # noqa: E731
    if not any(map(is_box, jax.tree.leaves(tree, is_leaf=is_box))):
        return tree
    return jax.tree.map(lambda x: x.get_value() if is_box(x) else x, tree, is_leaf=is_box)


def unboxed_structure(params: Any) -> Any:
    """The treedef of ``params`` without its boxes (one value each: the leaves keep their
    order), which argument trees are flattened up to."""
    return jax.tree.structure(unbox(params))


def load_nnx_optimizer_state(optimizer: Any, state: Any) -> None:
    """Puts ``state`` (e.g. an :func:`muon_optax.import_state` result) into an
    ``nnx.Optimizer``, in place, and sets its ``step`` to ``state.count``.

    The optimizer must have been built with the transformation the state belongs to
    (``nnx.Optimizer(model, tx, wrt=nnx.Param)``); its state is replaced whole, so it may
    have been made for another device count or mode::

        portable = muon_optax.export_state(tx8, nnx.as_pure(opt8.opt_state), params)
        # ... save portable, restore it, then on the new devices:
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        muon_optax.load_nnx_optimizer_state(
            opt, muon_optax.import_state(tx, portable, nnx.as_pure(nnx.state(model, nnx.Param))))
    """
    from flax import nnx
    from flax.nnx.training.optimizer import to_opt_state

    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(f"load_nnx_optimizer_state: optimizer must be an nnx.Optimizer, got "
                        f"{type(optimizer).__name__}.")
    state = unbox(state)
    want = jax.tree.structure(nnx.as_pure(optimizer.opt_state))
    if jax.tree.structure(state) != want:
        raise ValueError("load_nnx_optimizer_state: the state's structure is not the "
                         "optimizer's: was it made (or imported) with the transformation "
                         f"given to nnx.Optimizer, for its model's params?\nstate:     "
                         f"{jax.tree.structure(state)}\noptimizer: {want}")
    optimizer.opt_state = nnx.data(to_opt_state(state))
    count = getattr(state, "count", None)
    if count is not None:
        optimizer.step[...] = jax.numpy.asarray(count, optimizer.step.get_value().dtype)
