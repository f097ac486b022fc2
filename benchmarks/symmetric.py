"""Does exploiting symmetry pay on XLA:CPU? Polar Express with half-computed symmetric products.

``X X^T``, ``A @ A`` and, in Gram space, ``M Q`` and ``M (A M)`` are symmetric. A product
known to be symmetric needs only its upper-left, upper-right and lower-right ``n/2``
blocks (the lower-left is the transpose of the upper-right): 3/4 of the FLOPs. Two ways
to get them:

- ``blocks3``: three ``n/2 x n/2`` products, assembled with ``jnp.block``;
- ``rows_corner``: two products, the top ``n/2`` rows in full (one wide matmul, which
  runs at a better rate than two half-size ones) and the lower-right corner;
- ``rows_corner_long``: ``rows_corner`` for the Gram matrices of the long side
  (``X X^T``) only, every ``r x r`` product in full, as the library writes it.

Each runs the library's iteration (direct steps for square stacks; two direct steps,
then Gram space, for rectangular ones; per matrix) with its symmetric products done that
way. ``library`` is ``muon_optax.polar.polar_express_stack``. All are timed interleaved,
in a rotated order, on one stack at a time; the first table gives the median per-rep ratio
to ``library`` and the largest difference from it. The second gives each form's error
against the rule's iteration in float64 (relative, Frobenius) on matrices of condition
number 10 and 1e4, beside the direct form's: speed is only worth having within the
accuracy the library's tests ask of the Gram-space form (3x the direct error, or 1e-5).

    PYTHONPATH=. python benchmarks/symmetric.py
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.params import basin_scaled, numpy_polar_express
from benchmarks.step_time import time_interleaved
from muon_optax.polar import (
    GRAM_DIRECT_STEPS,
    POLAR_EXPRESS_COEFFS,
    polar_express,
    polar_express_stack,
)

HIGHEST = jax.lax.Precision.HIGHEST


def _nt(a, b):  # a @ b.T
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST)


def _nn(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HIGHEST)


def blocks3_nt(a, b):
    """``a @ b.T``, known symmetric, from three n/2 blocks, one mirrored."""
    h = a.shape[0] // 2
    s11, s12, s22 = _nt(a[:h], b[:h]), _nt(a[:h], b[h:]), _nt(a[h:], b[h:])
    return jnp.block([[s11, s12], [s12.T, s22]])


def rows_corner_nt(a, b):
    """``a @ b.T``, known symmetric, from its top n/2 rows and its lower-right corner."""
    h = a.shape[0] // 2
    top, corner = _nt(a[:h], b), _nt(a[h:], b[h:])
    return jnp.concatenate([top, jnp.concatenate([top[:, h:].T, corner], axis=1)], axis=0)


def symmetric_polar(x, long_nt, small, ns_steps=5):
    """The library's iteration on one wide or square matrix; ``long_nt`` forms ``X X^T``,
    ``small(a, b)`` every symmetric ``r x r`` product ``a @ b`` (``b`` symmetric, so the
    half forms may take it as ``a @ b.T``)."""
    coeffs = POLAR_EXPRESS_COEFFS[:ns_steps]
    eye = jnp.eye(x.shape[0], dtype=x.dtype)
    square = x.shape[0] == x.shape[1]
    for a, b, c in coeffs if square else coeffs[:GRAM_DIRECT_STEPS]:
        g = long_nt(x, x)
        x = _nn(a * eye + b * g + c * small(g, g), x)
    if square:
        return x
    coeffs = coeffs[GRAM_DIRECT_STEPS:]
    g, q = long_nt(x, x), None
    for k, (a, b, c) in enumerate(coeffs):
        m = a * eye + b * g + c * small(g, g)
        q = m if q is None else small(m, q)  # m, q symmetric and commuting
        if k + 1 < len(coeffs):
            g = small(m, _nn(g, m))  # (g m)^T = m g = g m
    return _nn(q, x)


FORMS = {  # name: (long_nt, small)
    "blocks3": (blocks3_nt, blocks3_nt),
    "rows_corner": (rows_corner_nt, rows_corner_nt),
    "rows_corner_long": (rows_corner_nt, _nn),  # r x r products as the library writes them
}


def conditioned(rows: int, cols: int, log10_cond: float) -> np.ndarray:
    """A basin-scaled matrix with singular values spread over ``log10_cond`` decades."""
    rng = np.random.default_rng(0)
    u, _, vt = np.linalg.svd(rng.standard_normal((rows, cols)), full_matrices=False)
    x = (u * np.logspace(0, -log10_cond, min(rows, cols))) @ vt
    return x / (1.01 * np.linalg.norm(x))


def accuracy_table() -> None:
    print("\n| matrix | direct | library (Gram space) | "
          + " | ".join(FORMS) + " |  (relative error against float64)")
    print("|---|---:|---:|" + "---:|" * len(FORMS))
    for (r, c), cond in [((64, 256), 1), ((64, 256), 4), ((96, 288), 1), ((96, 288), 4)]:
        x = conditioned(r, c, cond)
        want = numpy_polar_express(x)  # x is float64
        x32 = jnp.asarray(x, jnp.float32)
        got = [polar_express(x32, 5, "direct"), polar_express(x32, 5, "gram")]
        got += [jax.jit(symmetric_polar, static_argnums=(1, 2))(x32, *f) for f in FORMS.values()]
        errs = [np.linalg.norm(np.asarray(g, np.float64) - want) / np.linalg.norm(want)
                for g in got]
        print(f"| ({r}, {c}), cond 1e{cond} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--accuracy-only", action="store_true",
                    help="only the error table against float64 (seconds, no timing)")
    args = ap.parse_args(argv)
    if args.accuracy_only:
        return accuracy_table()
    print("| stack (K, R, C) | library ms | " + " | ".join(f"{n} / library" for n in FORMS)
          + " | max abs difference |")
    print("|---|---:|" + "---:|" * len(FORMS) + "---:|")
    for k, r, c in [(16, 256, 256), (8, 256, 1024), (32, 512, 512), (16, 512, 2048)]:
        x = jnp.asarray(basin_scaled(np.random.default_rng(0), (k, r, c)))
        fns = {"library": jax.jit(lambda x: polar_express_stack(x, 5, "auto"))}
        for name, (long_nt, small) in FORMS.items():
            fns[name] = jax.jit(lambda x, f=long_nt, g=small: jnp.stack(
                [symmetric_polar(m, f, g) for m in x]))
        outs = {n: jax.block_until_ready(f(x)) for n, f in fns.items()}
        times = time_interleaved(
            {n: lambda f=f: jax.block_until_ready(f(x)) for n, f in fns.items()}, args.reps)
        ratios = [statistics.median(a / b for a, b in zip(times[n], times["library"]))
                  for n in FORMS]
        diff = max(float(jnp.max(jnp.abs(outs[n] - outs["library"]))) for n in FORMS)
        print(f"| ({k}, {r}, {c}) | {statistics.median(times['library']) * 1e3:.1f} | "
              + " | ".join(f"{q:.3f}" for q in ratios) + f" | {diff:.1e} |", flush=True)
    accuracy_table()


if __name__ == "__main__":
    main()
