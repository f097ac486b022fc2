"""Orthogonality against polar steps: basin (nanochat) and AOL (Turbo-Muon) preconditioning.

Turbo-Muon (arXiv:2512.04632) claims that AOL preconditioning lets the polar iteration
drop one step. This measures it: for each input matrix ``G = U S V^T`` and each number
of steps ``k``, the float32 iteration's distance to the exact polar factor ``U V^T``,

    err = ||O_k - U V^T||_F / ||U V^T||_F,     and the spread [min, max] of sigma(O_k),

for the basin scaling ``X / (1.01 ||X||_F + 1e-6)`` and for AOL's row scaling folded
into step one. AOL also moves the target: its fixed point is the polar factor of the
row-scaled matrix (the shift is printed per input). Three coefficient schedules: Polar
Express's first ``k`` triples, its last ``k`` (AOL's tighter lower bound may not need
the first, steepest step), and Keller Jordan's quintic repeated.

FLOPs are computed, not timed: a step costs ``4 r^2 c + 2 r^3`` matmul FLOPs for an
``r x c`` matrix (``r <= c``) with either scaling (AOL's row sums of ``|A|`` and its
scaling are ``O(r^2 + r c)``, like the basin's norm), so dropping one of ``k`` steps
saves ``1/k`` of the polar FLOPs.

    python benchmarks/preconditioning.py                 # d512: 512x512 and 512x2048
    python benchmarks/preconditioning.py --d 128 --max-steps 4     # a quick check

Inputs: a Gaussian matrix, and one with a power-law spectrum ``sigma_i = i^-1`` (as
momentum matrices tend to have; condition number ``r``) and random singular vectors.
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muon_optax.rule.coefficients import POLAR_EXPRESS_COEFFS, QUINTIC_COEFFS  # noqa: E402
from muon_optax.rule.polar import polar_flops, polar_iteration, precondition  # noqa: E402


def inputs(rows: int, cols: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Float64 test matrices of shape ``(rows, cols)``, ``rows <= cols``."""
    rng = np.random.default_rng(seed)
    gaussian = rng.standard_normal((rows, cols))
    u, _ = np.linalg.qr(rng.standard_normal((rows, rows)))
    v, _ = np.linalg.qr(rng.standard_normal((cols, rows)))
    power = (u * (1.0 / np.arange(1, rows + 1))) @ v.T
    return {"gaussian": gaussian, "power-law 1/i": power}


def polar_factor(g: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    return u @ vt


def aol_target_shift(g: np.ndarray) -> float:
    """How far AOL moves the target: ``||polar(D G) - polar(G)||_F / ||polar(G)||_F``.

    AOL's row scaling ``D`` changes the singular vectors, so its iteration converges to
    the polar factor of ``D G``, not of ``G``: a floor under its error at any step count.
    """
    d = 1.0 / np.sqrt(np.abs(g @ g.T).sum(axis=1, keepdims=True))
    exact = polar_factor(g)
    return float(np.linalg.norm(polar_factor(d * g) - exact) / np.linalg.norm(exact))


def measure(o: jax.Array, exact: np.ndarray) -> tuple[float, float, float]:
    """``(err, sigma_min, sigma_max)`` of a float32 iterate against the exact factor."""
    o = np.asarray(o, np.float64)
    sigma = np.sqrt(np.clip(np.linalg.eigvalsh(o @ o.T), 0.0, None))
    return float(np.linalg.norm(o - exact) / np.linalg.norm(exact)), sigma[0], sigma[-1]


@jax.jit
def _basin(x):
    return precondition(x, "basin")


@functools.cache
def _step(kind: str, abc: tuple[float, float, float]):
    """One jitted step with ``abc``; ``kind="aol"`` folds AOL's scaling into it."""
    return jax.jit(lambda y: polar_iteration(y, (abc,), "direct", preconditioning=kind))


def run(x: jax.Array, coeffs, preconditioning: str) -> jax.Array:
    """The float32 iteration with ``coeffs``, one jitted step at a time."""
    if preconditioning == "basin":
        x = _basin(x)
    for i, abc in enumerate(coeffs):
        kind = preconditioning if i == 0 else "basin"  # basin: plain steps after the first
        x = _step(kind, tuple(float(v) for v in abc))(x)
    return x


def schedules() -> dict[str, Callable]:
    """Coefficient schedule name -> ``k -> coefficients of k steps`` (None: none)."""
    pe = POLAR_EXPRESS_COEFFS
    return {
        "Polar Express, first k": lambda k: pe[:k] if k <= len(pe) else None,
        "Polar Express, last k": lambda k: pe[len(pe) - k:] if k <= len(pe) else None,
        "quintic": lambda k: QUINTIC_COEFFS * k,
    }


def table(g: np.ndarray, schedule, max_steps: int) -> list[str]:
    exact = polar_factor(g)
    x = jnp.asarray(g, jnp.float32)
    lines = ["| steps | basin err | basin sigma | AOL err | AOL sigma |",
             "|---:|---:|---:|---:|---:|"]
    for k in range(1, max_steps + 1):
        coeffs = schedule(k)
        if coeffs is None:
            continue
        cells = []
        for kind in ("basin", "aol"):
            err, lo, hi = measure(run(x, coeffs, kind), exact)
            cells += [f"{err:.2e}", f"[{lo:.3f}, {hi:.3f}]"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d", type=int, default=512, help="model width: d x d and d x 4d")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}; float32 iteration, "
          "errors in float64 against the SVD's U V^T\n")
    for rows, cols in ((args.d, args.d), (args.d, 4 * args.d)):
        flops = [polar_flops(rows, cols, k, "direct") / 1e9
                 for k in range(1, args.max_steps + 1)]
        print(f"## {rows} x {cols}\n")
        print("GFLOP per matrix for k = 1.." + str(args.max_steps) + " steps: "
              + ", ".join(f"{f:.3g}" for f in flops) + "\n")
        for name, g in inputs(rows, cols, args.seed).items():
            print(f"{name} input: AOL's target is {aol_target_shift(g):.2e} (relative) from "
                  "the polar factor.\n")
            for label, schedule in schedules().items():
                print(f"### {name} input, {label}\n")
                print("\n".join(table(g, schedule, args.max_steps)) + "\n")


if __name__ == "__main__":
    main()
