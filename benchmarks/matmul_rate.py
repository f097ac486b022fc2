"""Is XLA:CPU's matmul the bottleneck? Its 2-D float32 rate beside NumPy's BLAS.

The polar iteration is almost all matmuls on a handful of shapes (``r x r x r`` and
``r x r x 4r`` for the model widths the benchmarks use). This times a jitted ``x @ y``
and ``numpy.matmul`` on the same float32 operands and prints GFLOP/s from the median
call. Every XLA shape is timed before NumPy runs at all: OpenBLAS's worker threads spin
for a while after each call, and XLA timed in between runs on a single free core (about
half its rate, measured). So the two columns are not interleaved; run the script more
than once on a shared machine.

A single 2-D call is not how the step uses the matmul: it traces one chain per matrix
and XLA runs two chains at once. So the second table times what a BLAS could replace,
a whole stack's direct Polar Express iteration: the library's
``polar_express_stack`` against the same steps in NumPy, run from the jitted program
through ``jax.pure_callback`` (one callback per stack, matrices one after another).

    PYTHONPATH=. python benchmarks/matmul_rate.py
    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python benchmarks/matmul_rate.py   # one BLAS core
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.params import basin_scaled, numpy_polar_express
from benchmarks.step_time import median_ms
from muon_optax.polar import polar_express_stack

DEFAULT_SHAPES = "256x256x256,512x512x512,512x2048x512,512x512x2048,1024x1024x1024"


def operands(m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((m, k), dtype=np.float32),
            rng.standard_normal((k, n), dtype=np.float32))


def numpy_stack(x: np.ndarray) -> np.ndarray:
    """A stack's direct Polar Express steps in NumPy, one matrix after another."""
    return np.stack([numpy_polar_express(m) for m in np.asarray(x)])


def stack_times(shape: tuple[int, ...], reps: int) -> tuple[float, float, float]:
    """Median ms of the library's stack iteration and of NumPy's through a callback."""
    x = jnp.asarray(basin_scaled(np.random.default_rng(0), shape))
    library = jax.jit(lambda x: polar_express_stack(x, 5, "direct"))
    blas = jax.jit(lambda x: jax.pure_callback(
        numpy_stack, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    diff = float(jnp.max(jnp.abs(library(x) - blas(x))))
    lib_ms, blas_ms = (median_ms(functools.partial(f, x), reps) for f in (library, blas))
    return lib_ms, blas_ms, diff


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per shape")
    ap.add_argument("--stacks", default="16x256,32x512",
                    help="square stacks KxN for the second table ('' to skip)")
    ap.add_argument("--stack-reps", type=int, default=8)
    args = ap.parse_args(argv)
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]

    def gflops(matmul, a, b) -> float:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1] / median_ms(
            functools.partial(matmul, a, b), args.reps) / 1e6

    xla = {}
    for shape in shapes:
        a, b = (jnp.asarray(x) for x in operands(*shape))
        xla[shape] = gflops(jax.jit(jnp.matmul).lower(a, b).compile(), a, b)
    blas = {shape: gflops(np.matmul, *operands(*shape)) for shape in shapes}

    print("| (m, k) @ (k, n) | XLA GFLOP/s | NumPy GFLOP/s | XLA / NumPy |")
    print("|---|---:|---:|---:|")
    for m, k, n in shapes:
        x, y = xla[m, k, n], blas[m, k, n]
        print(f"| ({m}, {k}) @ ({k}, {n}) | {x:.1f} | {y:.1f} | {x / y:.2f} |")

    if not args.stacks:
        return
    print("\n| square stack | library ms | NumPy via pure_callback ms | library / NumPy | "
          "max abs difference |")
    print("|---|---:|---:|---:|---:|")
    for spec in args.stacks.split(","):
        k, n = (int(d) for d in spec.split("x"))
        lib, blas, diff = stack_times((k, n, n), args.stack_reps)
        print(f"| ({k}, {n}, {n}) | {lib:.1f} | {blas:.1f} | {lib / blas:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
