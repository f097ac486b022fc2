"""Polar Express: the batched orthogonalization at the heart of Muon.

Muon replaces a momentum matrix ``G`` by (an approximation of) its polar factor
``U V^T``, where ``G = U S V^T`` is the SVD: every singular value is pushed to about one.
Polar Express (Amsel, Persson, Musco, Gower, arXiv:2505.16932) does this with a few
matrix-only iterations, each an odd polynomial of the matrix with its own coefficients:

    X_{k+1} = a_k X_k + b_k (X_k X_k^T) X_k + c_k (X_k X_k^T)^2 X_k

The Gram matrix is taken on the short side, so a wide ``(R, C)`` matrix (``R <= C``)
works with ``R x R`` products and a tall one with ``C x C`` products. Every function here
is batched over leading axes: a stack ``(K, R, C)`` is K independent matrices computed as
one XLA program, which is what nanochat gets from torch.compile'd kernels.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.rule.coefficients import (
    POLAR_EXPRESS_COEFFS,
    Coeffs,
    check_ns_steps,
    ns_coefficients,
)
from muon_optax.rule.platform import per_platform

# How the matrix is brought into the iteration's basin (spectral norm <= 1):
#   basin      X / (1.01 ||X||_F + 1e-6)            nanochat (fused with MuonEq in muon.py)
#   frobenius  X / (||X||_F + eps)                  optax's default
#   spectral   X / (||X||_2 + eps)                  exact, but an SVD
#   aol        rows scaled by 1/sqrt(sum_j |A_ij|), A = X X^T, inside the first step
#   schatten   X / sqrt(||X X^T||_F) (the Schatten-4 norm), inside the first step
PRECONDITIONINGS = ("basin", "frobenius", "spectral", "aol", "schatten")


def default_compute_dtype() -> jnp.dtype:
    """bfloat16 on accelerators, float32 on CPU (where bf16 matmuls are slow)."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def check_preconditioning(kind: object, where: str,
                          allowed: tuple[str, ...] = PRECONDITIONINGS) -> str:
    """``kind`` is one of ``allowed``; else a ``ValueError`` naming ``where`` and them."""
    if not isinstance(kind, str) or kind not in allowed:
        close = difflib.get_close_matches(str(kind), allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{where}: unknown preconditioning {kind!r}{hint}; use one of "
                         f"{', '.join(map(repr, allowed))}.")
    return kind


# Entries above this size could overflow float32 when squared and summed: 2**48 squared
# is 2**96, which leaves 2**32 entries of room under float32's 2**128.
_SQUARE_SAFE = 2.0 ** 48


def overflow_scale(x32: jax.Array) -> jax.Array:
    """A power of two per matrix (over the last two axes, keepdims) that brings the
    largest ``|x|`` into ``[1/2, 1)`` when it exceeds ``2**48``, else exactly 1.

    Norms of ``x * s`` then cannot overflow, and dividing them by ``s`` gives the norms
    of ``x``: a power of two scales without rounding, so for ordinary magnitudes
    (``s = 1``) the arithmetic is the unscaled one, bit for bit.
    """
    biggest = jnp.max(jnp.abs(x32), axis=(-2, -1), keepdims=True)
    _, exponent = jnp.frexp(biggest)  # biggest = m * 2**exponent, m in [1/2, 1)
    return jnp.where(biggest > _SQUARE_SAFE, jnp.ldexp(jnp.float32(1), -exponent), 1.0)


def fro_norm(x: jax.Array) -> jax.Array:
    """Frobenius norm of each matrix over the last two axes, in float32, keepdims.

    Computed on ``x`` scaled by :func:`overflow_scale`, so any finite ``x`` whose norm is
    below float32's maximum gets it (a plain sum of squares overflows above ~1e19).
    """
    x = x.astype(jnp.float32)
    s = overflow_scale(x)
    x = x * s
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True)) / s


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    # float32 means true float32: without HIGHEST, GPUs may run TF32 matmuls.
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.matmul(a, b, precision=precision)


# The Gram-space form first runs this many steps directly: they lift the small singular
# values (by about a_1 * a_2 = 33x) so that the Gram matrix formed afterwards still
# resolves them in float32. Starting in Gram space at once loses them (errors ~1e-3 at
# condition number 1e4; ~2e-5 this way, as direct float32).
GRAM_DIRECT_STEPS = 2


def polar_flops(rows: int, cols: int, ns_steps: int, method: str) -> int:
    """Matmul FLOPs of :func:`polar_express` on one ``rows x cols`` matrix."""
    r, c = min(rows, cols), max(rows, cols)
    direct_step = 4 * r * r * c + 2 * r**3              # Gram, A @ A, B @ X
    if method == "direct" or ns_steps <= GRAM_DIRECT_STEPS + 1:
        return ns_steps * direct_step
    k = ns_steps - GRAM_DIRECT_STEPS
    # Gram-space steps: A @ A each, M @ Q but the first, M A M but the last; plus one
    # Gram matrix and the final Q X on the long side.
    return GRAM_DIRECT_STEPS * direct_step + 4 * r * r * c + (2 * k + 6 * (k - 1)) * r**3


def choose_method(rows: int, cols: int, ns_steps: int, method: str = "direct",
                  dtype: Any = jnp.float32) -> str:
    """``auto``: Gram space where it saves FLOPs and the arithmetic is float32."""
    if method not in ("auto", "direct", "gram"):
        raise ValueError(f"polar method must be 'auto', 'direct' or 'gram', got {method!r}.")
    if method != "auto":
        return method
    cheaper = polar_flops(rows, cols, ns_steps, "gram") < polar_flops(rows, cols, ns_steps,
                                                                       "direct")
    return "gram" if cheaper and jnp.dtype(dtype) == jnp.float32 else "direct"


def _polynomial(gram: jax.Array, a: float, b: float, c: float) -> jax.Array:
    """``a I + b A + c A^2`` for a Gram matrix ``A``, formed in float32, rounded once.

    A Python float times a bfloat16 array is a bfloat16 constant in JAX, so written
    plainly every coefficient would be rounded to bf16 (8.1875 for 8.1566, -22.5 for
    -22.483) and each of the three terms and the sums rounded again. PyTorch keeps its
    scalars in float32 and rounds each term; here the whole matrix is rounded once.
    Against the float64 iteration, 5 bf16 steps land 0.014 to 0.020 away instead of
    0.057 to 0.079 (tests/test_polar.py). In float32 compute this is the plain formula.
    """
    f32 = jnp.float32
    eye = jnp.eye(gram.shape[-1], dtype=f32)
    square = _matmul(gram, gram)
    m = a * eye + b * gram.astype(f32) + c * square.astype(f32)
    return m.astype(gram.dtype)


# Write the loops out (the polar steps, CPU's matrices): the GPU form (XLA:GPU runs a
# while loop's iterations with a host round trip each: 0.6 ms of a 6 ms d768x12 step on
# an H200), and tests, so that XLA's cost analysis (a loop body counted once) sees all
# the work it measures. Read at trace time; see :func:`written_out`.
UNROLL_STEPS = False


@contextlib.contextmanager
def written_out(on: bool = True):
    """Traces the polar loops written out (``on``) inside the ``with`` block."""
    global UNROLL_STEPS
    before, UNROLL_STEPS = UNROLL_STEPS, on or UNROLL_STEPS
    try:
        yield
    finally:
        UNROLL_STEPS = before


def _direct_step(x: jax.Array, a, b, c) -> jax.Array:
    """One Polar Express step as the rule writes it, on the short side's Gram matrix.

    ``a X + (b A + c A^2) X`` is computed as ``(a I + b A + c A^2) X``: the a-term goes
    on the small side, saving a pass over the long side per step.
    """
    if x.shape[-2] > x.shape[-1]:  # tall: A = X^T X; X (a I + b A + c A^2)
        return _matmul(x, _polynomial(_matmul(jnp.swapaxes(x, -1, -2), x), a, b, c))
    # wide or square: A = X X^T; (a I + b A + c A^2) X
    return _matmul(_polynomial(_matmul(x, jnp.swapaxes(x, -1, -2)), a, b, c), x)


def _direct_steps(x: jax.Array, coeffs) -> jax.Array:
    """The steps of ``coeffs`` as a loop over its rows (one step's program, run
    ``len(coeffs)`` times).

    Written out, five steps are five copies of the step in the compiled program; the
    TPU compiler spends most of a Muon update's compile time and memory on such copies
    (BENCHMARKS.md, "The TPU compiler"). The coefficients are float32 scalars read from
    the table, the values a Python float would give.
    """
    if len(coeffs) == 1 or UNROLL_STEPS:
        for abc in coeffs:
            x = _direct_step(x, *abc)
        return x
    table = jnp.asarray(np.asarray(coeffs, np.float32))

    def step(x, abc):
        return _direct_step(x, abc[0], abc[1], abc[2]), None

    return jax.lax.scan(step, x, table)[0]


def _gram_space_steps(x: jax.Array, coeffs) -> jax.Array:
    """The same steps carried out on the short side's ``r x r`` matrices.

    From ``X_0 = x`` (wide) every iterate is ``X_k = Q_k X_0`` with ``Q_k`` a polynomial
    in ``A_0 = X_0 X_0^T``, so ``Q_k``, ``A_k = X_k X_k^T`` and
    ``M_k = a I + b A_k + c A_k^2`` all commute: ``X_{k+1} = M_k X_k`` gives
    ``Q_{k+1} = M_k Q_k`` and ``A_{k+1} = M_k A_k M_k``. Only ``A_0`` and the final
    ``Q X_0`` touch the long side.
    """
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    gram = _matmul(x, jnp.swapaxes(x, -1, -2))
    q = None
    for k, (a, b, c) in enumerate(coeffs):
        m = _polynomial(gram, a, b, c)
        q = m if q is None else _matmul(m, q)
        if k + 1 < len(coeffs):
            gram = _matmul(m, _matmul(gram, m))
    x = _matmul(q, x)
    return jnp.swapaxes(x, -1, -2) if tall else x


def polar_express(x: jax.Array, ns_steps: int = 5, method: str = "direct") -> jax.Array:
    """Runs the first ``ns_steps`` Polar Express iterations on ``x`` (..., R, C) as is.

    ``x`` must already be scaled so that its spectral norm is at most one (see
    :func:`orthogonalize`). The matmuls run in ``x.dtype``; each step's polynomial
    ``a I + b A + c A^2`` is formed in float32 and rounded once to it. ``method``:

    - ``"direct"``: every step on ``X``, as the rule writes it;
    - ``"gram"``: two direct steps, then the rest on the short side's Gram matrix: the
      same polynomial, other rounding, fewer FLOPs for rectangular matrices (1.3x for
      a 4:1 matrix and 5 steps);
    - ``"auto"``: ``"gram"`` where it saves FLOPs and ``x`` is float32.
    """
    check_ns_steps(ns_steps, "polar_express")
    return polar_iteration(x, POLAR_EXPRESS_COEFFS[:ns_steps], method)


def precondition(x: jax.Array, kind: str, eps: float = 1e-8) -> jax.Array:
    """Scales each matrix of ``x`` (..., R, C) into the iteration's basin, in ``x.dtype``.

    ``basin``: ``X / (1.01 ||X||_F + 1e-6)``; ``frobenius``: ``X / (||X||_F + eps)``;
    ``spectral``: ``X / (||X||_2 + eps)`` (an SVD per matrix). ``aol`` and ``schatten``
    scale inside the first step (:func:`preconditioned_step`): ``x`` is returned as is.
    Norms and the scaling in float32, rounded once to ``x.dtype``.
    """
    if kind in ("aol", "schatten"):
        return x
    x32 = x.astype(jnp.float32)
    if kind == "basin":
        return (x32 / (1.01 * fro_norm(x) + 1e-6)).astype(x.dtype)
    if kind == "frobenius":
        return (x32 / (fro_norm(x) + eps)).astype(x.dtype)
    if kind == "spectral":
        sv = jnp.linalg.svd(x32, compute_uv=False)
        return (x32 / (jnp.max(sv, axis=-1)[..., None, None] + eps)).astype(x.dtype)
    raise ValueError(f"unknown preconditioning {kind!r}; use one of {PRECONDITIONINGS}.")


def preconditioned_step(x: jax.Array, abc: tuple[float, float, float],
                        kind: str) -> jax.Array:
    """The first iteration with AOL or Schatten-4 scaling folded into its Gram matrix.

    With ``A = X X^T`` on the short side (rows here; a tall ``x`` is run transposed):

    - ``aol`` (Turbo-Muon, arXiv:2512.04632): ``D = diag(1 / sqrt(sum_j |A_ij|))``, a
      row scaling that bounds the spectral norm by one (Gershgorin) and is often far
      tighter than the Frobenius norm; ``X <- D X``, ``A <- D A D``;
    - ``schatten``: ``s = 1 / sqrt(||A||_F)``, i.e. ``X / ||X||_{S4}``;
      ``X <- s X``, ``A <- s^2 A``.

    Both clamp the sums at 1e-8, so a zero matrix stays zero. Then
    ``X <- (a I + b A + c A^2) X`` as every other step. ``A`` is formed once. The
    scalings and the polynomial are formed in float32 and rounded once.
    """
    if x.shape[-2] > x.shape[-1]:
        return jnp.swapaxes(preconditioned_step(jnp.swapaxes(x, -1, -2), abc, kind), -1, -2)
    a, b, c = abc
    f32, dtype = jnp.float32, x.dtype
    gram = _matmul(x, jnp.swapaxes(x, -1, -2)).astype(f32)
    if kind == "aol":
        s = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(gram), axis=-1, keepdims=True), 1e-8))
        x, gram = x.astype(f32) * s, gram * s * jnp.swapaxes(s, -1, -2)
    elif kind == "schatten":
        s = jax.lax.rsqrt(jnp.maximum(jnp.sqrt(jnp.sum(gram * gram, axis=(-2, -1),
                                                       keepdims=True)), 1e-8))
        x, gram = x.astype(f32) * s, gram * (s * s)
    else:
        raise ValueError(f"preconditioned_step: kind must be 'aol' or 'schatten', got {kind!r}.")
    return _matmul(_polynomial(gram.astype(dtype), a, b, c), x.astype(dtype))


def polar_iteration(x: jax.Array, coeffs: Coeffs, method: str = "direct", *,
                    preconditioning: str = "basin") -> jax.Array:
    """One odd-polynomial step per ``(a, b, c)`` row of ``coeffs`` on ``x`` (..., R, C).

    ``x`` must already be scaled (:func:`precondition`), except for ``"aol"`` and
    ``"schatten"``, whose scaling is part of the first step (:func:`preconditioned_step`).
    ``method`` as in :func:`polar_express`, for the steps after that first one.
    """
    coeffs = tuple(coeffs)
    if preconditioning in ("aol", "schatten") and coeffs:
        x, coeffs = preconditioned_step(x, coeffs[0], preconditioning), coeffs[1:]
    if not coeffs:
        return x
    method = choose_method(x.shape[-2], x.shape[-1], len(coeffs), method, x.dtype)
    if method == "direct" or len(coeffs) <= GRAM_DIRECT_STEPS + 1:
        return _direct_steps(x, coeffs)
    x = _direct_steps(x, coeffs[:GRAM_DIRECT_STEPS])
    return _gram_space_steps(x, coeffs[GRAM_DIRECT_STEPS:])


def polar_express_stack(x: jax.Array, ns_steps: int = 5, method: str = "direct", *,
                        coeffs: Coeffs | None = None,
                        preconditioning: str = "basin") -> jax.Array:
    """:func:`polar_express` on a stack ``(K, R, C)``: batched on accelerators, one
    matrix at a time on CPU.

    XLA:CPU runs a batched ``(K, R, C)`` dot 1.06x to 1.17x slower than K 2-D dots
    (BENCHMARKS.md), so there the matrices go through a loop (``lax.map``), which also
    keeps one matrix's temporaries alive instead of the stack's. The platform is the one
    the step is compiled for (``lax.platform_dependent``), not the process's default: a
    program compiled ahead of time for a TPU from a CPU host gets the TPU's form.
    With ``coeffs`` (one ``(a, b, c)`` per step) it runs :func:`polar_iteration` with
    them and ``preconditioning`` instead; ``ns_steps`` is then ``len(coeffs)``.
    """
    if coeffs is None:
        coeffs = POLAR_EXPRESS_COEFFS[:check_ns_steps(ns_steps, "polar_express")]

    def batched(y):
        return polar_iteration(y, coeffs, method, preconditioning=preconditioning)

    if x.shape[0] <= 1:
        return batched(x)
    def one_by_one(y):
        if UNROLL_STEPS:
            return jnp.concatenate([batched(y[i:i + 1]) for i in range(y.shape[0])])
        return jax.lax.map(batched, y)

    return per_platform("polar", x, cpu=one_by_one, default=batched)


def orthogonalize(
    x: jax.Array,
    ns_steps: int = 5,
    *,
    compute_dtype: jnp.dtype | str | None = None,
    method: str = "direct",
    ns_coeffs: Any = "polar_express",
    preconditioning: str = "basin",
    eps: float = 1e-8,
) -> jax.Array:
    """Approximate polar factor of each matrix in ``x`` (..., R, C).

    Scales each matrix into the iteration's basin, ``X / (1.01 ||X||_F + 1e-6)``, then
    runs ``ns_steps`` Polar Express iterations in ``compute_dtype`` (default: float32 on
    CPU, bfloat16 on GPU/TPU). Returns the result in ``compute_dtype``. A zero matrix
    stays zero. ``method`` as in :func:`polar_express`.

    ``ns_coeffs`` (a preset of :data:`NS_COEFF_PRESETS`, a triple or an ``(n, 3)``
    table; see :func:`ns_coefficients`) and ``preconditioning`` (one of
    :data:`PRECONDITIONINGS`; ``eps`` for ``frobenius``/``spectral``) choose another
    iteration.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs (..., R, C) matrices, got shape {x.shape}.")
    coeffs = ns_coefficients(ns_coeffs, ns_steps, "orthogonalize")
    check_preconditioning(preconditioning, "orthogonalize")
    dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else default_compute_dtype()
    x = precondition(x.astype(dtype), preconditioning, eps)
    return polar_iteration(x, coeffs, method, preconditioning=preconditioning)
