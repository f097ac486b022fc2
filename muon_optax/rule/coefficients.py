"""The polar iteration's coefficients, each step's ``(a, b, c)`` of
``X <- a X + b (X X^T) X + c (X X^T)^2 X``: the published tables and how a user names one."""

from __future__ import annotations

import difflib
import operator
from typing import Any

import jax
import numpy as np

Coeffs = tuple[tuple[float, float, float], ...]

# Polar Express's 5 iterations (safety factor 2e-2, cushion 2), as in the paper and nanochat.
POLAR_EXPRESS_COEFFS: Coeffs = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

# Keller Jordan's quintic Newton-Schulz triple (modded-nanogpt; optax.contrib.muon's "standard"),
# repeated: the steepest slope at zero that keeps the singular values near one (about [0.7, 1.2]).
QUINTIC_COEFFS: Coeffs = ((3.4445, -4.7750, 2.0315),)

# Dion's five-step table (Ahn et al., arXiv:2504.05295), optax.contrib.muon's "dion".
DION_COEFFS: Coeffs = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# muon_optax.muon's presets (see ns_coefficients)
NS_COEFF_PRESETS = {"polar_express": POLAR_EXPRESS_COEFFS, "quintic": QUINTIC_COEFFS}


def did_you_mean(word: object, choices: Any) -> str:
    """`` (did you mean 'x'?)``, ``x`` the nearest of ``choices`` to a misspelt ``word``, or ""."""
    close = difflib.get_close_matches(str(word), choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_ns_steps(ns_steps: object, where: str = "orthogonalize") -> int:
    """``ns_steps`` as a static int in 1..5 (Polar Express's rows): it sets the program's
    length. A JAX array is refused even when concrete, as ``optax.inject_hyperparams``
    makes one (traced)."""
    most = len(POLAR_EXPRESS_COEFFS)
    if isinstance(ns_steps, jax.Array):
        raise TypeError(f"{where}: ns_steps must be a Python int in 1..{most}, got a JAX array "
                        f"({ns_steps!r}); it is static (it sets the program's length). With "
                        "optax.inject_hyperparams pass static_args=(\"ns_steps\",).")
    try:
        if isinstance(ns_steps, (bool, np.bool_)):
            raise TypeError
        ns_steps = operator.index(ns_steps)  # int, NumPy integer, 0-d integer ndarray
    except TypeError:
        raise TypeError(f"{where}: ns_steps must be a Python int in 1..{most}, "
                        f"got {ns_steps!r}.") from None
    if not 1 <= ns_steps <= most:
        raise ValueError(f"{where}: ns_steps={ns_steps} is outside 1..{most}; Polar Express "
                         f"has coefficients for {most} iterations.")
    return ns_steps


def coefficient_rows(ns_coeffs: Any, where: str,
                     presets: dict[str, Coeffs] = NS_COEFF_PRESETS) -> tuple[Coeffs, bool]:
    """``(rows, is_table)`` of a preset name, a triple ``(a, b, c)`` or an ``(n, 3)`` table."""
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in presets:
            raise ValueError(f"{where}: unknown ns_coeffs preset {ns_coeffs!r}"
                             f"{did_you_mean(ns_coeffs, presets)}; presets are "
                             f"{', '.join(map(repr, presets))}, or a triple or an (n, 3) table.")
        rows = presets[ns_coeffs]
        return rows, len(rows) > 1
    try:
        table = np.asarray(ns_coeffs, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: ns_coeffs must be a preset name, a triple (a, b, c) or "
                         f"an (n, 3) table of numbers, got {ns_coeffs!r}.") from e
    if table.ndim not in (1, 2) or table.shape[-1] != 3 or table.size == 0:
        raise ValueError(f"{where}: ns_coeffs must be a triple (a, b, c) (shape (3,)) or an "
                         f"(n, 3) table, one row per iteration; got shape {table.shape}.")
    if not np.all(np.isfinite(table)):
        raise ValueError(f"{where}: ns_coeffs holds a non-finite number: {table.tolist()}.")
    rows = tuple(tuple(float(v) for v in row) for row in table.reshape(-1, 3))
    return rows, table.ndim == 2


def ns_coefficients(ns_coeffs: Any, ns_steps: object, where: str = "muon") -> Coeffs:
    """Each iteration's ``(a, b, c)``: a triple (or one-row preset) repeated, or a table's rows."""
    if isinstance(ns_coeffs, str) and ns_coeffs == "polar_express":
        return POLAR_EXPRESS_COEFFS[:check_ns_steps(ns_steps, where)]
    rows, is_table = coefficient_rows(ns_coeffs, where)
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        raise TypeError(f"{where}: ns_steps must be a Python int >= 1, got {ns_steps!r}.")
    if ns_steps < 1:
        raise ValueError(f"{where}: ns_steps={ns_steps}; Muon needs at least one iteration.")
    if not is_table:
        return rows * ns_steps
    if len(rows) < ns_steps:
        raise ValueError(f"{where}: ns_coeffs has {len(rows)} rows, too few for "
                         f"ns_steps={ns_steps} (one row per iteration); pass ns_steps <= "
                         f"{len(rows)} or a longer table.")
    return rows[:ns_steps]
