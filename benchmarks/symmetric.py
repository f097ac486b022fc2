"""Does exploiting symmetry pay on XLA:CPU? Polar Express with half-computed symmetric products.

``X X^T``, ``A @ A`` and, in Gram space, ``M Q`` and ``M (A M)`` are symmetric. A product
known to be symmetric can be computed from 3 of its 4 ``n/2`` blocks (upper-left,
upper-right, lower-right; the lower-left is the transpose of the upper-right): 3/4 of the
FLOPs. ``symmetric`` runs the library's iteration (direct steps for square stacks, two
direct steps then Gram space for rectangular ones, per matrix) with every such product
done that way; ``library`` is ``muon_optax.polar.polar_express_stack``. Both are timed
interleaved on one stack at a time, and their largest difference is printed.

    PYTHONPATH=. python benchmarks/symmetric.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.polar import GRAM_DIRECT_STEPS, POLAR_EXPRESS_COEFFS, polar_express_stack

HIGHEST = jax.lax.Precision.HIGHEST


def _nt(a, b):  # a @ b.T
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST)


def _nn(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HIGHEST)


def sym_nt(a, b):
    """``a @ b.T`` for a product known to be symmetric: three n/2 blocks, one mirrored."""
    h = a.shape[0] // 2
    s11, s12, s22 = _nt(a[:h], b[:h]), _nt(a[:h], b[h:]), _nt(a[h:], b[h:])
    return jnp.block([[s11, s12], [s12.T, s22]])


def direct_steps(x, coeffs):
    eye = jnp.eye(x.shape[0], dtype=x.dtype)
    for a, b, c in coeffs:
        g = sym_nt(x, x)
        x = _nn(a * eye + b * g + c * sym_nt(g, g), x)  # g symmetric: g @ g = g @ g.T
    return x


def gram_space_steps(x, coeffs):
    eye = jnp.eye(x.shape[0], dtype=x.dtype)
    g, q = sym_nt(x, x), None
    for k, (a, b, c) in enumerate(coeffs):
        m = a * eye + b * g + c * sym_nt(g, g)
        q = m if q is None else sym_nt(m, q)  # m, q symmetric and commuting
        if k + 1 < len(coeffs):
            g = sym_nt(m, _nn(g, m))  # (g m)^T = m g = g m
    return _nn(q, x)


def symmetric_polar(x, ns_steps=5):
    coeffs = POLAR_EXPRESS_COEFFS[:ns_steps]
    if x.shape[0] == x.shape[1]:
        return direct_steps(x, coeffs)
    x = direct_steps(x, coeffs[:GRAM_DIRECT_STEPS])
    return gram_space_steps(x, coeffs[GRAM_DIRECT_STEPS:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    print("| stack (K, R, C) | library ms | symmetric ms | symmetric / library (median per rep) "
          "| max abs difference |")
    print("|---|---:|---:|---:|---:|")
    for k, r, c in [(16, 256, 256), (8, 256, 1024), (32, 512, 512), (16, 512, 2048)]:
        x = np.random.default_rng(0).standard_normal((k, r, c), dtype=np.float32)
        x = jnp.asarray(x / (1.01 * np.linalg.norm(x, axis=(1, 2), keepdims=True)))
        fns = {"library": jax.jit(lambda x: polar_express_stack(x, 5, "auto")),
               "symmetric": jax.jit(lambda x: jnp.stack([symmetric_polar(m) for m in x]))}
        outs = {n: jax.block_until_ready(f(x)) for n, f in fns.items()}
        times = {n: [] for n in fns}
        for rep in range(args.reps):
            for n in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
                t0 = time.perf_counter()
                jax.block_until_ready(fns[n](x))
                times[n].append(time.perf_counter() - t0)
        ratio = statistics.median(a / b for a, b in zip(times["symmetric"], times["library"]))
        diff = float(jnp.max(jnp.abs(outs["symmetric"] - outs["library"])))
        print(f"| ({k}, {r}, {c}) | {statistics.median(times['library']) * 1e3:.1f} | "
              f"{statistics.median(times['symmetric']) * 1e3:.1f} | {ratio:.3f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
