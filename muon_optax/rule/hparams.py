"""Parameter groups: nanochat's ``param_groups`` dicts without ``params`` (only ``lr`` is
required), checked once, read per step. A scalar is a number or an optax schedule, evaluated
on the traced step count (never recompiling); ``ns_steps`` and the Muon options are static:

    dict(kind="adamw", lr=..., betas=(b1, b2), eps=..., weight_decay=...)
    dict(kind="muon",  lr=..., momentum=..., ns_steps=..., beta2=..., weight_decay=...)"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.rule import adamw, muon
from muon_optax.rule.coefficients import POLAR_EXPRESS_COEFFS, Coeffs, did_you_mean, ns_coefficients
from muon_optax.rule.polar import check_preconditioning

Scalar = float | Callable[[jax.Array], Any]  # a number, or an optax schedule count -> number

ADAMW_DEFAULTS = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
MUON_DEFAULTS = dict(momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.0)
MUON_OPTIONS = ("row_equilibration", "renormalize", "compute_dtype", "polar_method",
                "ns_coeffs", "nesterov", "normuon", "cautious", "preconditioning", "mu_dtype")


def value_at(x: Scalar, count: jax.Array) -> jax.Array:
    """The float32 value of a hyperparameter at step ``count``."""
    return jnp.asarray(x(count) if callable(x) else x, jnp.float32)


def check_scalar(value: Any, name: str, where: str) -> Scalar:
    """A number as a Python float; a 0-d array (``optax.inject_hyperparams``'s, traced) or
    a schedule (if it returns a scalar, traced on an abstract count) as is."""
    if callable(value):
        try:
            out = jax.eval_shape(value, jax.ShapeDtypeStruct((), jnp.int32))
        except Exception:  # noqa: BLE001 - one that does not trace so fails, or not, where used
            return value
        shape = getattr(out, "shape", None)
        if shape != ():
            what = f"an array of shape {shape}" if shape is not None else type(out).__name__
            raise TypeError(f"{where}: {name} is a schedule that returns {what}; a schedule "
                            f"must return one number per step (a scalar).")
        return value
    real = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if real or (isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0
                and any(jnp.issubdtype(value.dtype, t) for t in (jnp.floating, jnp.integer))):
        check_finite(value, name, where)
        return float(value) if real else value
    raise TypeError(f"{where}: {name} must be a float or an optax schedule "
                    f"(a callable of the step count), got {value!r}.")


def concrete_value(value: Any) -> float | None:
    """A number or 0-d array as a Python float when it is known now; None when traced."""
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError, jax.errors.JAXTypeError):
        return None


def check_finite(value: Any, name: str, where: str) -> None:
    """Refuses a hyperparameter known now to be NaN or infinite; a traced value passes."""
    x = concrete_value(value)
    if x is not None and not np.isfinite(x):
        raise ValueError(f"{where}: {name} must be a finite number, got {x}; a NaN or inf "
                         f"hyperparameter makes every update NaN.")


def check_flag(flag: Any, name: str, where: str) -> bool:
    if not isinstance(flag, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {flag!r}.")
    return flag


def check_dtype(dtype: Any, name: str, where: str) -> Any:
    """``compute_dtype`` (None: the backend's default) or ``mu_dtype`` (None: the parameter
    dtype; else as JAX stores it, float64 being float32 without x64): a float dtype or None."""
    compute = name == "compute_dtype"
    if compute and isinstance(dtype, (jax.Array, np.ndarray)):
        raise TypeError(f"{where}: compute_dtype must be a dtype, got an array ({dtype!r}). "
                        "With optax.inject_hyperparams, a dtype such as jnp.bfloat16 is callable "
                        "and taken for a schedule: pass static_args=(\"ns_steps\", "
                        "\"compute_dtype\") or the dtype's name (\"bfloat16\").")
    if dtype is None:
        return None
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as e:
        default = "the backend's default" if compute else "the parameter dtype"
        raise TypeError(f"{where}: {name} {dtype!r} is not a dtype; use jnp.float32 or "
                        f"jnp.bfloat16 (or None for {default}).") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{where}: {name} must be a float dtype, got {dtype}.")
    return dtype if compute else jax.dtypes.canonicalize_dtype(dtype)


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """An AdamW group of nanochat's rule (:func:`muon_optax.adamw`'s arguments, checked);
    ``step`` is its kernel. optax's Adam is :class:`~muon_optax.rule.contrib.OptaxAdamConfig`."""

    lr: Scalar
    b1: Scalar
    b2: Scalar
    eps: Scalar
    weight_decay: Scalar
    mu_dtype: ClassVar[Any] = None  # the first moment in the parameter's dtype

    @classmethod
    def make(cls, lr, betas, eps, weight_decay, where="adamw") -> AdamWConfig:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"{where}: betas must be a pair (b1, b2), got {betas!r}.")
        return cls(*(check_scalar(v, n, where) for v, n in (
            (lr, "lr"), (betas[0], "betas[0]"), (betas[1], "betas[1]"), (eps, "eps"),
            (weight_decay, "weight_decay"))))

    def needs_params(self) -> bool:
        """Whether ``update`` reads the params: weight decay not the constant zero."""
        return not isinstance(self.weight_decay, float) or self.weight_decay != 0.0

    def at(self, count: jax.Array) -> dict[str, jax.Array]:
        """The hyperparameters at step ``count``."""
        return {k: value_at(getattr(self, k), count)
                for k in ("lr", "b1", "b2", "eps", "weight_decay")}

    step = staticmethod(adamw.adamw_leaf_update)  # (g, p, m, v, t, hp) -> (update, m, v)


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """A Muon group of nanochat's rule: :func:`muon_optax.muon`'s arguments, checked. The
    engine calls its methods, as :class:`~muon_optax.rule.contrib.ContribConfig`'s."""

    lr: Scalar
    momentum: Scalar
    beta2: Scalar
    weight_decay: Scalar
    ns_steps: int = 5
    row_equilibration: bool = True
    renormalize: bool = True
    compute_dtype: Any = None
    polar_method: str = "auto"
    ns_coeffs: Coeffs | None = None
    preconditioning: str = "basin"
    nesterov: bool = True
    normuon: bool = True
    cautious: bool = True
    mu_dtype: Any = None
    eps: ClassVar[float] = 1e-8           # of the frobenius and spectral preconditionings
    leaf_scaled: ClassVar[bool] = False  # no factor summed over a whole leaf

    @classmethod
    def make(cls, lr, momentum, ns_steps, beta2, weight_decay, row_equilibration=True,
             renormalize=True, compute_dtype=None, polar_method="auto", *,
             ns_coeffs="polar_express", preconditioning="basin", nesterov=True,
             normuon=True, cautious=True, mu_dtype=None, where="muon") -> MuonConfig:
        coeffs = ns_coefficients(ns_coeffs, ns_steps, where)
        if polar_method not in ("direct", "gram", "auto"):
            raise ValueError(f"{where}: polar_method must be 'direct' (the rule as written), "
                             f"'gram' or 'auto', got {polar_method!r}.")
        flags = {name: check_flag(value, name, where) for name, value in (
            ("row_equilibration", row_equilibration), ("renormalize", renormalize),
            ("nesterov", nesterov), ("normuon", normuon), ("cautious", cautious))}
        scalars = (check_scalar(v, n, where) for v, n in (
            (lr, "lr"), (momentum, "momentum"), (beta2, "beta2"), (weight_decay, "weight_decay")))
        return cls(*scalars, ns_steps=len(coeffs), polar_method=polar_method,
                   compute_dtype=check_dtype(compute_dtype, "compute_dtype", where),
                   ns_coeffs=None if coeffs == POLAR_EXPRESS_COEFFS[:len(coeffs)] else coeffs,
                   preconditioning=check_preconditioning(preconditioning, where),
                   mu_dtype=check_dtype(mu_dtype, "mu_dtype", where), **flags)

    @property
    def coeffs(self) -> Coeffs:
        """The ``(a, b, c)`` of each of the ``ns_steps`` iterations."""
        return POLAR_EXPRESS_COEFFS[:self.ns_steps] if self.ns_coeffs is None else self.ns_coeffs

    def at(self, count: jax.Array) -> dict[str, jax.Array]:
        """The hyperparameters at step ``count`` (steps taken before this one)."""
        return {k: value_at(getattr(self, k), count)
                for k in ("lr", "momentum", "beta2", "weight_decay")}

    def static_key(self) -> tuple:
        """What must agree for two matrices to share one batched program."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)[4:])

    step = muon.muon_step          # (g, state, hp, count, dtype) -> (O, state, None)
    leaf_update = muon.leaf_update  # (o, p, lr, weight_decay, *, rows, cols) -> update


def static_float(value: Any, name: str, where: str) -> float:
    """A number fixed at construction (it shapes the program, not a schedule's value)."""
    try:
        number = float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}: {name} must be a number (static, not a schedule), "
                        f"got {value!r}.") from e
    check_finite(number, name, where)
    return number


def parse_group(name: str, group: Mapping[str, Any]) -> AdamWConfig | MuonConfig:
    """Checks one nanochat-style group dict and returns its config."""
    where = f"group {name!r}"
    if not isinstance(group, Mapping):
        raise TypeError(f"{where}: expected a dict like dict(kind='muon', lr=...), "
                        f"got {type(group).__name__}.")
    if "params" in group:
        raise ValueError(f"{where}: a group holds no 'params' here; say which parameters "
                         "belong to it through param_labels.")
    kind = group.get("kind")
    if kind not in ("adamw", "muon"):
        raise ValueError(f"{where}: unknown kind {kind!r}; use kind='adamw' or kind='muon'.")
    defaults, config = ((ADAMW_DEFAULTS, AdamWConfig) if kind == "adamw"
                        else (MUON_DEFAULTS, MuonConfig))
    allowed = ("kind", "lr", *defaults) + (MUON_OPTIONS if kind == "muon" else ())
    unknown = [f"{k!r}{did_you_mean(k, allowed)}" for k in group if k not in allowed]
    if unknown:
        raise ValueError(f"{where}: unknown hyperparameter {', '.join(unknown)} for kind={kind!r}; "
                         f"allowed keys are {', '.join(allowed)}.")
    if "lr" not in group:
        raise ValueError(f"{where}: missing hyperparameter lr for kind={kind!r}; "
                         f"{'an' if kind == 'adamw' else 'a'} {kind} group needs lr (the rest "
                         f"default to muon_optax.{kind}'s defaults).")
    hp = {**defaults, **{k: v for k, v in group.items() if k != "kind"}}
    return config.make(where=where, **hp)


def parse_groups(groups: Mapping[str, Mapping[str, Any]]) -> dict[str, AdamWConfig | MuonConfig]:
    if not isinstance(groups, Mapping) or not groups:
        raise TypeError("groups must be a non-empty dict: group name -> dict(kind=..., ...).")
    return {str(name): parse_group(str(name), g) for name, g in groups.items()}


def current_hyperparams(groups_or_tx: Any, state: Any) -> dict[str, dict[str, jax.Array]]:
    """For logging: each group's hyperparameters for the next update, eagerly or under jit.

    Args:
      groups_or_tx: the transformation returned by :func:`muon_optax.muon_adamw` (or
        ``muon``, ``adamw``), or the ``groups`` dict given to ``muon_adamw``.
      state: its state (its step count ``state.count``), or the count itself.

    Returns:
      ``{group: {name: float32 scalar}}``, the values the next ``tx.update`` uses: ``lr, b1,
      b2, eps, weight_decay`` for AdamW groups, ``lr, momentum, beta2, weight_decay`` for Muon
      groups (a matrix with more rows than columns steps with ``lr * sqrt(rows / cols)``).
    """
    configs = getattr(getattr(groups_or_tx, "init", None), "configs", None)
    if configs is None and isinstance(groups_or_tx, Mapping) and groups_or_tx:
        configs = groups_or_tx
        if not all(isinstance(c, (AdamWConfig, MuonConfig)) for c in configs.values()):
            configs = parse_groups(configs)
    if configs is None:
        raise TypeError("current_hyperparams: pass the transformation made by muon_adamw (or "
                        "muon, adamw) itself, not one wrapped by optax.chain or others, or the "
                        f"groups dict given to muon_adamw; got {type(groups_or_tx).__name__}.")
    count = getattr(state, "count", state)
    if not (isinstance(count, (int, np.integer, jax.Array, np.ndarray)) and jnp.ndim(count) == 0
            and jnp.issubdtype(getattr(count, "dtype", type(count)), jnp.integer)):
        raise TypeError("current_hyperparams: state must be the muon_adamw state (a "
                        "MuonAdamWState) or its step count; from a chain's state pass its "
                        f"muon_adamw part, e.g. state[1]. Got {type(state).__name__}.")
    count = jnp.asarray(count)
    return {name: cfg.at(count) for name, cfg in configs.items()}
