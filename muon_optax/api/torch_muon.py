"""``torch_muon``: ``torch.optim.Muon``'s rule and names (PyTorch 2.13) on the engine.

The rule, per matrix ``P`` of shape ``(out, in)``, gradient ``g`` (torch's defaults):

    buf = lerp(buf, g, 1 - momentum)                     (an EMA, no bias correction)
    U   = lerp(g, buf, momentum)   (nesterov)   or   buf
    O   = NewtonSchulz(U / (||U||_F + eps))     ns_steps times (a, b, c) = ns_coefficients
    P   = P - lr wd P - lr s O                  s = sqrt(max(1, out / in))   ("original")
                                                s = 0.2 sqrt(max(out, in))   ("match_rms_adamw")

It maps onto a :class:`~muon_optax.rule.contrib.ContribConfig` without ``adam``: nanochat's momentum
(the same lerps), Frobenius preconditioning, ``consistent_rms`` for ``"match_rms_adamw"``. Unlike
here (within its rounding), torch divides by ``max(||U||_F, eps)`` and always iterates in bfloat16.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np
import optax

from muon_optax.api.optimizer import build
from muon_optax.params.dimension_numbers import MuonDimensionNumbers
from muon_optax.params.labels import path_str
from muon_optax.rule.contrib import ContribConfig
from muon_optax.rule.hparams import Scalar

TORCH_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
ADJUST_LR_FNS = {None: None, "original": None, "match_rms_adamw": 0.2}
# torch's (out, in), leading axes batch (a scanned (L, out, in) stack is L matrices).
PYTORCH_LAYOUT = MuonDimensionNumbers(reduction_axis=-1, output_axis=-2)

_WHERE = "torch_muon"


def _coefficients(ns_coefficients: Any, ns_steps: Any) -> tuple[tuple[float, float, float], ...]:
    try:
        a, b, c = (float(x) for x in np.asarray(ns_coefficients, np.float64).reshape(-1))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{_WHERE}: ns_coefficients must be three numbers (a, b, c), used at "
                         f"every step, got {ns_coefficients!r}.") from e
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, (int, np.integer)):
        raise TypeError(f"{_WHERE}: ns_steps must be an int (static: it sets the program's "
                        f"length), got {ns_steps!r}. With optax.inject_hyperparams pass "
                        "static_args=(\"ns_steps\", \"eps\").")
    if not 1 <= ns_steps < 100:
        raise ValueError(f"{_WHERE}: ns_steps={ns_steps}; use 1..99 (torch.optim.Muon "
                         "refuses 100 or more; 0 would leave the momentum unorthogonalized).")
    return ((a, b, c),) * int(ns_steps)


def _labels(params: Any) -> Any:
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if np.ndim(x) < 2:
            raise ValueError(
                f"{_WHERE}: parameter {path_str(path)!r} has shape {tuple(np.shape(x))}; "
                "torch.optim.Muon takes matrices only, and so does torch_muon. Give vectors "
                "and scalars to another optimizer, e.g. optax.partition({'muon': "
                "muon_optax.torch_muon(...), 'adamw': optax.adamw(...)}, labels), or use "
                "muon_optax.muon_adamw.")
    return jax.tree.map(lambda _: "muon", params)


def torch_muon(
    lr: Scalar = 1e-3,
    weight_decay: Scalar = 0.1,
    momentum: Scalar = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = TORCH_NS_COEFFICIENTS,
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    *,
    dimension_numbers: Any = None,
    compute_dtype: Any = None,
    axis_name: str | tuple[str, ...] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformation:
    """``torch.optim.Muon`` on muon_optax's engine: its arguments, names and defaults.

    Every leaf is a Muon matrix in PyTorch's ``(out, in)`` layout (leading axes batch); give
    vectors and scalars to another optimizer (``optax.partition``), as with torch. The rule:
    the module docstring.

    Args:
      lr: learning rate, or an optax schedule of the step count (torch's LR schedulers).
      weight_decay: decoupled decay at the raw ``lr`` (not the shape-adjusted one).
      momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn: as in the rule
        above (``None`` is ``"original"``).
      dimension_numbers: ``MuonDimensionNumbers`` (a tree of them or a callable; blocks
        allowed); default ``(reduction_axis=-1, output_axis=-2)``.
      compute_dtype: dtype of the iteration: default float32 on CPU, else bfloat16 (torch's).
      axis_name, mesh, param_specs, max_grad_norm, skip_nonfinite: as in
        :func:`muon_optax.muon_adamw` (ZeRO-2, ``mesh=``, clipping, skipped steps).

    Returns:
      An ``optax.GradientTransformation`` (a :class:`MuonAdamWState`); ``update`` needs params.
    """
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"{_WHERE}: adjust_lr_fn={adjust_lr_fn!r}; use None or 'original' "
                         "(lr sqrt(max(1, out / in))) or 'match_rms_adamw' "
                         "(0.2 lr sqrt(max(out, in))).")
    for value, name in ((lr, "lr"), (momentum, "momentum"), (weight_decay, "weight_decay")):
        # as torch, refuse negative numbers (a schedule or an array is taken as is)
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and not value >= 0:
            raise ValueError(f"{_WHERE}: {name}={value!r}; it must be >= 0 (torch.optim.Muon "
                             "refuses it too).")
    cfg = ContribConfig.make(
        lr, momentum, weight_decay, _coefficients(ns_coefficients, ns_steps), eps=eps,
        nesterov=nesterov, compute_dtype=compute_dtype, adam=False,
        consistent_rms=ADJUST_LR_FNS[adjust_lr_fn], where=_WHERE)
    dimension_numbers = PYTORCH_LAYOUT if dimension_numbers is None else dimension_numbers
    return build({"muon": cfg}, _labels, _WHERE, dimension_numbers, axis_name, mesh, param_specs,
                 max_grad_norm, skip_nonfinite)
