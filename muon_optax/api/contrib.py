"""``contrib_muon``: optax.contrib.muon's rule on muon_optax's engine.

Same arguments, defaults and updates (float32: within 1e-5 of optax's parameter change),
with the engine's stacking of same-shape matrices, sharding (``axis_name``, ``mesh``) and
:func:`muon_optax.state_specs`. The rule, as optax 0.2.8 computes it:

    Muon leaves (2-D by default, or as ``muon_weight_dimension_numbers`` says):
      m = beta m + (1 - beta) g
      U = beta m / (1 - beta^(t+1)) + (1 - beta) g / (1 - beta^t)   (nesterov)
      U = m / (1 - beta^t)                                           (nesterov=False)
      O = NewtonSchulz(precondition(U))           per matrix, one (a, b, c) per step
      O = <U, O> O                                (adaptive; summed over the leaf)
      update = -lr (s O + wd P [mask])            s = sqrt(max(1, out/in)), or
                                                  sqrt(max(in, out)) * consistent_rms
    other leaves: optax.adamw(adam_learning_rate or learning_rate, adam_b1, adam_b2,
      eps, adam_eps_root, adam_weight_decay, mu_dtype, nesterov)
"""

import dataclasses
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from muon_optax.api.optimizer import build
from muon_optax.params.dimension_numbers import (
    MuonDimensionNumbers,
    block_counts,
    is_dimension_numbers,
)
from muon_optax.rule import coefficients
from muon_optax.rule.contrib import ContribConfig, OptaxAdamConfig
from muon_optax.rule.hparams import Scalar
from muon_optax.rule.polar import check_preconditioning
from muon_optax.state.optax_state import ADAM, MUON, MUON_NO_DECAY

# optax's names ("standard", "dion"), and muon_optax's for the same or more.
CONTRIB_PRESETS: dict[str, coefficients.Coeffs] = {
    "standard": coefficients.QUINTIC_COEFFS, "dion": coefficients.DION_COEFFS,
    "quintic": coefficients.QUINTIC_COEFFS, "polar_express": coefficients.POLAR_EXPRESS_COEFFS}
CONTRIB_PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")

_FLAX_LAYOUT = MuonDimensionNumbers(reduction_axis=0, output_axis=1)


def contrib_coefficients(ns_coeffs: Any, ns_steps: Any,
                         where: str = "contrib_muon") -> coefficients.Coeffs:
    """The ``(a, b, c)`` of every iteration, as optax.contrib.muon reads its arguments: a
    triple (or ``"standard"``) runs ``ns_steps`` times; a table (``"dion"``, an ``(n, 3)``
    array) runs its ``n`` rows, one per step, where ``ns_steps >= n`` (optax's rule)."""
    try:
        steps = operator.index(ns_steps)
    except TypeError as e:
        raise TypeError(f"{where}: ns_steps must be an int, got {ns_steps!r}.") from e
    if isinstance(ns_steps, bool) or steps < 1:
        raise ValueError(f"{where}: ns_steps={ns_steps!r}; Muon needs at least one "
                         "Newton-Schulz iteration (optax would return the preconditioned "
                         "momentum unorthogonalized).")
    rows, is_table = coefficients.coefficient_rows(ns_coeffs, where, CONTRIB_PRESETS)
    if not is_table:
        return rows * steps
    if len(rows) > steps:
        raise ValueError(
            f"{where}: ns_coeffs is a table of {len(rows)} rows, one per iteration, but "
            f"ns_steps={steps}: too few steps for its coefficients (optax.contrib.muon "
            f"refuses this too, saying 'Not enough coeffs'). Pass ns_steps >= {len(rows)}, "
            f"or keep the last {steps} rows (ns_coeffs[-{steps}:]).")
    return rows


class _Split:
    """Per leaf: Muon or Adam, its dimension numbers, and whether it is decayed."""

    def __init__(self, dimension_numbers: Any, mask: Any):
        self.spec, self.mask = dimension_numbers, mask

    def dims(self, params: Any) -> list[Any]:
        """Per leaf (flattening order) its ``MuonDimensionNumbers``, or None for Adam."""
        leaves, treedef = jax.tree.flatten(params)
        if self.spec is None:  # optax's default: exactly the 2-D leaves
            return [_FLAX_LAYOUT if np.ndim(x) == 2 else None for x in leaves]
        tree = self.spec(params) if callable(self.spec) else self.spec
        is_leaf = lambda x: x is None or is_dimension_numbers(x)  # noqa: E731
        try:
            dims = treedef.flatten_up_to(jax.tree.broadcast(tree, params, is_leaf=is_leaf))
        except (ValueError, TypeError) as e:
            raise ValueError(
                "contrib_muon: muon_weight_dimension_numbers must be a tree with the params' "
                "structure, or a prefix of it, holding MuonDimensionNumbers (Muon) or None "
                "(Adam), or a callable params -> such a tree. Params: "
                f"{treedef}; got {jax.tree.structure(tree, is_leaf=is_leaf)}.") from e
        # optax orthogonalizes a 2-D leaf as laid out, its dimension numbers used for the
        # shape scaling only. Only AOL on a square can tell (it scales the rows), and a
        # square's scaling is 1 either way: run 2-D squares as (rows, cols) = axes (0, 1).
        return [_FLAX_LAYOUT if d is not None and np.ndim(x) == 2 and x.shape[0] == x.shape[1]
                and block_counts(d) == (1, 1) else d for x, d in zip(leaves, dims)]

    def decayed(self, params: Any, dims: list[Any]) -> list[bool]:
        """Per leaf: whether the Muon weight decay applies. As optax's, the mask (or the
        callable's result on the params, ``MaskedNode()`` at Adam leaves): bools, a prefix."""
        leaves, treedef = jax.tree.flatten(params)
        if self.mask is None:
            return [True] * len(leaves)
        masked = optax.MaskedNode()
        view = treedef.unflatten([x if d is not None else masked for x, d in zip(leaves, dims)])
        mask = self.mask(view) if callable(self.mask) else self.mask
        index = treedef.unflatten([i if d is not None else masked for i, d in enumerate(dims)])
        try:
            kept = jax.tree.map(lambda flag, sub: sub if flag else masked, mask, index)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "contrib_muon: weight_decay_mask must be a tree of Python bools with the "
                "params' structure (or a prefix of it), or a callable params -> such a "
                f"tree. Params: {treedef}; got {jax.tree.structure(mask)}.") from e
        chosen = set(jax.tree.leaves(kept))
        return [i in chosen for i in range(len(leaves))]

    def labels(self, params: Any) -> Any:
        dims = self.dims(params)
        return jax.tree.structure(params).unflatten(
            [ADAM if d is None else MUON if w else MUON_NO_DECAY
             for d, w in zip(dims, self.decayed(params, dims))])

    def reasons(self, params: Any) -> Any:
        """Why each leaf went where it did (for :func:`muon_optax.describe`)."""
        given, dims = "muon_weight_dimension_numbers", self.dims(params)
        why = [(f"{given} None" if self.spec is not None else "not 2-D (optax's rule)")
               if d is None else (given if self.spec is not None else "2-D (optax's rule)")
               + ("" if w else ", weight_decay_mask False")
               for d, w in zip(dims, self.decayed(params, dims))]
        return jax.tree.structure(params).unflatten(why)

    def dimension_numbers(self, params: Any) -> Any:
        return jax.tree.structure(params).unflatten(self.dims(params))


@dataclasses.dataclass(frozen=True, eq=False, repr=False, slots=True)
class Fixed:
    """A default that ``optax.inject_hyperparams`` leaves alone (it injects ints, floats and
    arrays), equal to and shown as its number: see :func:`contrib_muon`."""

    value: int | float

    def __repr__(self) -> str:
        return repr(self.value)

    def __eq__(self, other: object) -> bool:
        return self.value == (other.value if isinstance(other, Fixed) else other)

    def __hash__(self) -> int:
        return hash(self.value)


def static_number(value: Any, name: str) -> Any:
    """A number that shapes the program: a :class:`Fixed` unwrapped, a concrete 0-d array
    (``optax.inject_hyperparams`` outside ``jax.jit``) as a Python number; traced: an error."""
    if isinstance(value, Fixed):
        return value.value
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"contrib_muon: {name} arrives traced (optax.inject_hyperparams under jax.jit), but "
            f"it fixes the compiled program. Leave it at its default (which inject_hyperparams "
            f"does not inject), or pass static_args=({name!r},) to optax.inject_hyperparams.")
    if isinstance(value, (jax.Array, np.ndarray)) and np.ndim(value) == 0:
        return np.asarray(value).item()
    return value


def contrib_muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Any = coefficients.QUINTIC_COEFFS[0],
    ns_steps: int = Fixed(5),  # type: ignore[assignment]
    beta: float = 0.95,
    eps: float = Fixed(1e-8),  # type: ignore[assignment]
    weight_decay: Scalar = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: Scalar = 0.9,
    adam_b2: Scalar = 0.999,
    adam_eps_root: Scalar = 0.0,
    adam_weight_decay: Scalar = 0.0,
    adam_learning_rate: Scalar | None = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: float | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """``optax.contrib.muon`` on muon_optax's engine: a drop-in with the same updates.

    Arguments as ``optax.contrib.muon`` (optax 0.2.8), its names and defaults (the rule: the
    module docstring). Differences: ``ns_coeffs`` also takes ``"quintic"`` (= ``"standard"``)
    and ``"polar_express"``; a table longer than ``ns_steps``, ``ns_steps < 1`` and complex
    parameters are refused; Newton-Schulz runs in float32 (optax: the momentum's dtype).

    Under ``optax.inject_hyperparams(contrib_muon)`` numbers are injected as for optax's, except
    ``ns_steps`` and ``eps`` at their defaults (they fix the program; no ``static_args`` needed);
    given explicitly, pass them in ``static_args``, as ``consistent_rms`` and array ``ns_coeffs``.

    Args (the engine's additions):
      axis_name, mesh, param_specs, max_grad_norm, skip_nonfinite: as in
        :func:`muon_optax.muon_adamw` (sharding, clipping, skipped non-finite steps).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (a :class:`MuonAdamWState`); ``update``
      needs ``params`` and ignores extra keyword arguments (``value=loss``, ...), as optax's.
    """
    where = "contrib_muon"
    ns_steps, eps = static_number(ns_steps, "ns_steps"), static_number(eps, "eps")
    ns_coeffs = static_number(ns_coeffs, "ns_coeffs")
    if isinstance(ns_coeffs, (jax.Array, np.ndarray)):
        ns_coeffs = np.asarray(ns_coeffs).tolist()
    consistent_rms = static_number(consistent_rms, "consistent_rms")
    coeffs = contrib_coefficients(ns_coeffs, ns_steps, where)
    check_preconditioning(preconditioning, where, CONTRIB_PRECONDITIONINGS)
    muon_cfg = ContribConfig.make(
        learning_rate, beta, weight_decay, coeffs, preconditioning=preconditioning, eps=eps,
        nesterov=nesterov, compute_dtype=jnp.float32, mu_dtype=mu_dtype, adaptive=adaptive,
        consistent_rms=consistent_rms, where=where)
    adam_lr = learning_rate if adam_learning_rate is None else adam_learning_rate
    configs: dict[str, OptaxAdamConfig | ContribConfig] = {
        MUON: muon_cfg,
        ADAM: OptaxAdamConfig.make(adam_lr, (adam_b1, adam_b2), eps, adam_weight_decay,
                                   eps_root=adam_eps_root, nesterov=nesterov, mu_dtype=mu_dtype)}
    if weight_decay_mask is not None:   # undecayed Muon leaves (stacked with the decayed ones)
        configs[MUON_NO_DECAY] = dataclasses.replace(muon_cfg, weight_decay=0.0)
    split = _Split(muon_weight_dimension_numbers, weight_decay_mask)
    tx = build(configs, split.labels, where, split.dimension_numbers, axis_name, mesh,
               param_specs, max_grad_norm, skip_nonfinite)

    def update(updates, state, params=None, **extra_args):  # extra_args ignored, as optax's
        return tx.update(updates, state, params)

    return optax.GradientTransformationExtraArgs(tx.init, update)
