"""Parameter groups: nanochat's per-group hyperparameters, checked once, read per step.

A group is a dict in nanochat's ``param_groups`` format, without ``params``:

    dict(kind="adamw", lr=..., betas=(b1, b2), eps=..., weight_decay=...)
    dict(kind="muon",  lr=..., momentum=..., ns_steps=..., beta2=..., weight_decay=...)

Every scalar is a number or an optax schedule (a callable of the step count). Schedules
are evaluated inside the jitted update on the traced step count, so a changing value
never recompiles anything. ``ns_steps`` and the Muon options are static: they choose the
program, not a number in it.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.polar import (
    POLAR_EXPRESS_COEFFS,
    Coeffs,
    check_preconditioning,
    ns_coefficients,
)

Scalar = float | Callable[[jax.Array], Any]
"""A hyperparameter: a number, or an optax schedule ``count -> number``."""

ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
MUON_KEYS = ("lr", "momentum", "ns_steps", "beta2", "weight_decay")
MUON_OPTIONS = ("row_equilibration", "renormalize", "compute_dtype", "polar_method",
                "ns_coeffs", "nesterov", "normuon", "cautious", "preconditioning", "mu_dtype")


def value_at(x: Scalar, count: jax.Array) -> jax.Array:
    """The float32 value of a hyperparameter at step ``count``."""
    return jnp.asarray(x(count) if callable(x) else x, jnp.float32)


def _check_scalar(value: Any, name: str, where: str) -> Scalar:
    if callable(value):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    if (isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0
            and jnp.issubdtype(value.dtype, jnp.floating)):
        return value
    raise TypeError(f"{where}: {name} must be a float or an optax schedule "
                    f"(a callable of the step count), got {value!r}.")


def _check_flag(flag: Any, name: str, where: str) -> bool:
    if not isinstance(flag, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {flag!r}.")
    return flag


def _check_dtype(dtype: Any, name: str, where: str, default: str) -> Any:
    """A float dtype, or None (``default`` says what None means)."""
    if dtype is None:
        return None
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{where}: {name} {dtype!r} is not a dtype; use jnp.float32 or "
                        f"jnp.bfloat16 (or None for {default}).") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{where}: {name} must be a float dtype, got {dtype}.")
    return dtype


def _mu_dtype(dtype: Any, where: str) -> Any:
    """A momentum dtype as JAX stores it (float64 is float32 without x64), or None."""
    dtype = _check_dtype(dtype, "mu_dtype", where, "the parameter dtype")
    return None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """Hyperparameters of an AdamW group (see :func:`muon_optax.adamw`).

    ``eps_root``, ``nesterov`` and ``mu_dtype`` are optax's Adam options (used by
    :func:`muon_optax.contrib_muon`): ``sqrt(v_hat + eps_root)``, Nesterov's bias-corrected
    look-ahead, the first moment's dtype (None: the parameter's). ``optax_ema``: the
    moments as optax computes them, ``m = (1 - b1) g + b1 m`` with ``1 - b1`` from the
    exact constant and the product ``b1 m`` in ``m``'s dtype (likewise ``v``).
    """

    lr: Scalar
    b1: Scalar
    b2: Scalar
    eps: Scalar
    weight_decay: Scalar
    eps_root: Scalar = 0.0
    nesterov: bool = False
    mu_dtype: Any = None
    optax_ema: bool = False

    @classmethod
    def make(cls, lr, betas, eps, weight_decay, where="adamw", *, eps_root=0.0,
             nesterov=False, mu_dtype=None, optax_ema=False) -> AdamWConfig:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"{where}: betas must be a pair (b1, b2), got {betas!r}.")
        scalars = (_check_scalar(v, n, where) for v, n in (
            (lr, "lr"), (betas[0], "betas[0]"), (betas[1], "betas[1]"), (eps, "eps"),
            (weight_decay, "weight_decay")))
        return cls(*scalars, eps_root=_check_scalar(eps_root, "eps_root", where),
                   nesterov=_check_flag(nesterov, "nesterov", where),
                   mu_dtype=_mu_dtype(mu_dtype, where),
                   optax_ema=_check_flag(optax_ema, "optax_ema", where))

    def needs_params(self) -> bool:
        return callable(self.weight_decay) or self.weight_decay != 0.0


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """Hyperparameters and static options of a Muon group (see :func:`muon_optax.muon`).

    The defaults are nanochat's rule. The options after ``polar_method`` choose another
    rule (:func:`muon_optax.contrib_muon` sets them to optax.contrib.muon's):

    - ``ns_coeffs``: the ``(a, b, c)`` of each iteration (``ns_steps`` rows), or None
      for Polar Express's first ``ns_steps``;
    - ``preconditioning``: one of :data:`muon_optax.polar.PRECONDITIONINGS`; ``eps`` is
      the one of ``frobenius``/``spectral``;
    - ``nesterov``: Nesterov look-ahead (else the momentum buffer itself);
      ``bias_correction``: divide by ``1 - momentum^t`` as Adam does (needs the step);
    - ``normuon``: NorMuon's variance reduction; ``cautious``: decay only where the
      update and the weight agree in sign;
    - ``mu_dtype``: dtype of the momentum buffer (None: the parameter's);
      ``optax_ema``: ``buf = (1 - mu) g + mu buf`` as optax computes it, the product
      ``mu buf`` in the buffer's dtype and ``1 - mu`` from the exact constant (else a
      float32 lerp);
    - ``adaptive``: scale the direction by ``<U, O>`` summed over the leaf;
    - ``consistent_rms``: the lr scale ``sqrt(max(R, C)) * consistent_rms`` instead of
      ``sqrt(max(1, R / C))`` (see :func:`muon_optax.muon.matrix_lr_scale`);
    - ``scale_decay``: the decay's lr includes that scale (nanochat) or not (optax).
    """

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
    eps: float = 1e-8
    bias_correction: bool = False
    adaptive: bool = False
    consistent_rms: float | None = None
    scale_decay: bool = True
    optax_ema: bool = False

    @classmethod
    def make(cls, lr, momentum, ns_steps, beta2, weight_decay, row_equilibration=True,
             renormalize=True, compute_dtype=None, polar_method="auto", *,
             ns_coeffs="polar_express", preconditioning="basin", nesterov=True,
             normuon=True, cautious=True, mu_dtype=None, eps=1e-8, bias_correction=False,
             adaptive=False, consistent_rms=None, scale_decay=True,
             optax_ema=False, where="muon") -> MuonConfig:
        coeffs = ns_coefficients(ns_coeffs, ns_steps, where)
        if polar_method not in ("direct", "gram", "auto"):
            raise ValueError(f"{where}: polar_method must be 'direct' (the rule as written), "
                             f"'gram' or 'auto', got {polar_method!r}.")
        flags = {name: _check_flag(value, name, where) for name, value in (
            ("row_equilibration", row_equilibration), ("renormalize", renormalize),
            ("nesterov", nesterov), ("normuon", normuon), ("cautious", cautious),
            ("bias_correction", bias_correction), ("adaptive", adaptive),
            ("scale_decay", scale_decay), ("optax_ema", optax_ema))}
        return cls(
            lr=_check_scalar(lr, "lr", where),
            momentum=_check_scalar(momentum, "momentum", where),
            beta2=_check_scalar(beta2, "beta2", where),
            weight_decay=_check_scalar(weight_decay, "weight_decay", where),
            ns_steps=len(coeffs), compute_dtype=_check_dtype(
                compute_dtype, "compute_dtype", where, "the backend's default"),
            polar_method=polar_method,
            ns_coeffs=None if coeffs == POLAR_EXPRESS_COEFFS[:len(coeffs)] else coeffs,
            preconditioning=check_preconditioning(preconditioning, where),
            mu_dtype=_mu_dtype(mu_dtype, where),
            eps=_static_float(eps, "eps", where),
            consistent_rms=None if consistent_rms is None else _static_float(
                consistent_rms, "consistent_rms", where),
            **flags)

    def momentum_complement(self) -> float | None:
        """``1 - momentum`` from the exact constant, for ``optax_ema``; None otherwise.

        It is part of :meth:`static_key`, so every matrix of a stack shares it.
        """
        if self.optax_ema and isinstance(self.momentum, float):
            return 1.0 - self.momentum
        return None

    @property
    def coeffs(self) -> Coeffs:
        """The ``(a, b, c)`` of each of the ``ns_steps`` iterations."""
        return POLAR_EXPRESS_COEFFS[:self.ns_steps] if self.ns_coeffs is None else self.ns_coeffs

    def static_key(self) -> tuple:
        """What must agree for two matrices to share one batched program."""
        return (self.ns_steps, self.row_equilibration, self.renormalize, self.compute_dtype,
                self.polar_method, self.coeffs, self.preconditioning, self.nesterov,
                self.normuon, self.cautious, self.mu_dtype, self.eps, self.bias_correction,
                self.adaptive, self.consistent_rms, self.scale_decay, self.optax_ema,
                self.momentum_complement())


def _static_float(value: Any, name: str, where: str) -> float:
    """A number fixed at construction (it shapes the program, not a schedule's value)."""
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}: {name} must be a number (static, not a schedule), "
                        f"got {value!r}.") from e


def _unknown(keys, allowed) -> str:
    parts = []
    for k in keys:
        close = difflib.get_close_matches(str(k), allowed, n=1)
        parts.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(parts)


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
    required = ADAMW_KEYS if kind == "adamw" else MUON_KEYS
    allowed = ("kind",) + required + (MUON_OPTIONS if kind == "muon" else ())
    unknown = [k for k in group if k not in allowed]
    if unknown:
        raise ValueError(f"{where}: unknown hyperparameter {_unknown(unknown, allowed)} for "
                         f"kind={kind!r}; allowed keys are {', '.join(allowed)}.")
    missing = [k for k in required if k not in group]
    if missing:
        raise ValueError(f"{where}: missing hyperparameter {', '.join(missing)} for "
                         f"kind={kind!r}; a {kind} group needs {', '.join(required)}.")
    hp = {k: v for k, v in group.items() if k != "kind"}
    if kind == "adamw":
        return AdamWConfig.make(where=where, **hp)
    return MuonConfig.make(where=where, **hp)


def parse_groups(groups: Mapping[str, Mapping[str, Any]]) -> dict[str, AdamWConfig | MuonConfig]:
    if not isinstance(groups, Mapping) or not groups:
        raise TypeError("groups must be a non-empty dict: group name -> dict(kind=..., ...).")
    return {str(name): parse_group(str(name), g) for name, g in groups.items()}
