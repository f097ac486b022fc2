"""Polar Express (Amsel, Persson, Musco, Gower, arXiv:2505.16932), Muon's orthogonalization:
a momentum ``G = U S V^T`` to (about) ``U V^T`` by a few odd-polynomial iterations, the Gram
matrix on the short side, batched over leading axes (a stack is one program):

    X_{k+1} = a_k X_k + b_k (X_k X_k^T) X_k + c_k (X_k X_k^T)^2 X_k"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.rule.coefficients import Coeffs, did_you_mean, ns_coefficients
from muon_optax.rule.platform import per_platform

# How a matrix is brought into the iteration's basin (spectral norm <= 1): see precondition.
PRECONDITIONINGS = ("basin", "frobenius", "spectral", "aol", "schatten")

# The Gram-space form first runs this many steps directly: they lift the small singular
# values so that the Gram matrix formed afterwards still resolves them.
GRAM_DIRECT_STEPS = 2

# Write the loops out (read at trace time, see written_out): for GPUs, which pay a host round
# trip per while-loop iteration, and for XLA's cost analysis, which counts a loop body once.
UNROLL_STEPS = False


def default_compute_dtype() -> jnp.dtype:
    """bfloat16 on accelerators, float32 on CPU (where bf16 matmuls are slow)."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def check_preconditioning(kind: object, where: str,
                          allowed: tuple[str, ...] = PRECONDITIONINGS) -> str:
    """``kind`` if it is one of ``allowed``, else a ``ValueError``."""
    if not isinstance(kind, str) or kind not in allowed:
        raise ValueError(f"{where}: unknown preconditioning {kind!r}{did_you_mean(kind, allowed)}"
                         f"; use one of {', '.join(map(repr, allowed))}.")
    return kind


def overflow_scale(x32: jax.Array) -> jax.Array:
    """A power of two per matrix (keepdims) that brings the largest ``|x|`` into
    ``[1/2, 1)`` when over ``2**48``, else 1: norms of ``x * s`` cannot overflow (``2**32``
    squares of ``2**48`` fit under ``2**128``), and the scaling does not round."""
    biggest = jnp.max(jnp.abs(x32), axis=(-2, -1), keepdims=True)
    _, exponent = jnp.frexp(biggest)  # biggest = m * 2**exponent, m in [1/2, 1)
    return jnp.where(biggest > 2.0**48, jnp.ldexp(jnp.float32(1), -exponent), 1.0)


def fro_norm(x: jax.Array) -> jax.Array:
    """Frobenius norm of each matrix, float32, keepdims, finite below float32's maximum."""
    x = x.astype(jnp.float32)
    s = overflow_scale(x)
    x = x * s
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True)) / s


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    # float32 means true float32: without HIGHEST, GPUs may run TF32 matmuls.
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.matmul(a, b, precision=precision)


def polar_flops(rows: int, cols: int, ns_steps: int, method: str) -> int:
    """Matmul FLOPs of :func:`polar_express` on one ``rows x cols`` matrix."""
    r, c = min(rows, cols), max(rows, cols)
    direct_step = 4 * r * r * c + 2 * r**3              # Gram, A @ A, B @ X
    if method == "direct" or ns_steps <= GRAM_DIRECT_STEPS + 1:
        return ns_steps * direct_step
    k = ns_steps - GRAM_DIRECT_STEPS
    # Gram space: the Gram matrix and final Q X (long side); A @ A, M @ Q but first, M A M but last
    return GRAM_DIRECT_STEPS * direct_step + 4 * r * r * c + (2 * k + 6 * (k - 1)) * r**3


def choose_method(rows: int, cols: int, ns_steps: int, method: str = "direct",
                  dtype: Any = jnp.float32) -> str:
    """``auto``: Gram space where it saves FLOPs and the arithmetic is float32."""
    if method not in ("auto", "direct", "gram"):
        raise ValueError(f"polar method must be 'auto', 'direct' or 'gram', got {method!r}.")
    if method != "auto":
        return method
    gram, direct = (polar_flops(rows, cols, ns_steps, m) for m in ("gram", "direct"))
    return "gram" if gram < direct and jnp.dtype(dtype) == jnp.float32 else "direct"


def _polynomial(gram: jax.Array, a: float, b: float, c: float) -> jax.Array:
    """``a I + b A + c A^2`` formed in float32, rounded once (plainly on a bfloat16 ``A``,
    JAX would round each coefficient and term)."""
    eye = jnp.eye(gram.shape[-1], dtype=jnp.float32)
    square = _matmul(gram, gram)
    m = a * eye + b * gram.astype(jnp.float32) + c * square.astype(jnp.float32)
    return m.astype(gram.dtype)


@contextlib.contextmanager
def written_out(on: bool = True):
    """Traces the polar loops written out (``on``) inside the block."""
    global UNROLL_STEPS
    before, UNROLL_STEPS = UNROLL_STEPS, on or UNROLL_STEPS
    try:
        yield
    finally:
        UNROLL_STEPS = before


def _direct_step(x: jax.Array, a, b, c) -> jax.Array:
    # (a I + b A + c A^2) X with A on the short side: the a-term there saves a long pass
    if x.shape[-2] > x.shape[-1]:  # tall: A = X^T X
        return _matmul(x, _polynomial(_matmul(jnp.swapaxes(x, -1, -2), x), a, b, c))
    return _matmul(_polynomial(_matmul(x, jnp.swapaxes(x, -1, -2)), a, b, c), x)


def _direct_steps(x: jax.Array, coeffs) -> jax.Array:
    """The steps as a loop: the TPU compiler's time and memory grow with each step written out."""
    if len(coeffs) == 1 or UNROLL_STEPS:
        for abc in coeffs:
            x = _direct_step(x, *abc)
        return x
    return jax.lax.scan(lambda x, abc: (_direct_step(x, abc[0], abc[1], abc[2]), None), x,
                        jnp.asarray(np.asarray(coeffs, np.float32)))[0]


def _gram_space_steps(x: jax.Array, coeffs) -> jax.Array:
    """The steps on the short side: for a wide ``X_0``, ``X_k = Q_k X_0``, and ``Q_k``,
    ``A_k = X_k X_k^T``, ``M_k = a I + b A_k + c A_k^2``, polynomials in ``A_0``, commute:
    ``Q_{k+1} = M_k Q_k``, ``A_{k+1} = M_k A_k M_k``."""
    if x.shape[-2] > x.shape[-1]:
        return jnp.swapaxes(_gram_space_steps(jnp.swapaxes(x, -1, -2), coeffs), -1, -2)
    gram = _matmul(x, jnp.swapaxes(x, -1, -2))
    q = None
    for k, (a, b, c) in enumerate(coeffs):
        m = _polynomial(gram, a, b, c)
        q = m if q is None else _matmul(m, q)
        if k + 1 < len(coeffs):
            gram = _matmul(m, _matmul(gram, m))
    return _matmul(q, x)


def polar_express(x: jax.Array, ns_steps: int = 5, method: str = "direct") -> jax.Array:
    """The first ``ns_steps`` iterations on ``x`` (..., R, C) of spectral norm <= 1, matmuls in
    ``x.dtype``. ``method``: ``"direct"`` (as written), ``"gram"`` (two direct steps, then the
    short side's: fewer FLOPs for rectangular matrices) or ``"auto"`` (:func:`choose_method`)."""
    return polar_iteration(x, ns_coefficients("polar_express", ns_steps, "polar_express"), method)


def precondition(x: jax.Array, kind: str, eps: float = 1e-8) -> jax.Array:
    """Scales each matrix of ``x`` into the basin (``frobenius``, ``spectral``: optax's), in
    float32 rounded to ``x.dtype``; ``aol``, ``schatten``: in :func:`preconditioned_step`."""
    if kind in ("aol", "schatten"):
        return x
    x32 = x.astype(jnp.float32)
    if kind == "basin":
        return (x32 / (1.01 * fro_norm(x) + 1e-6)).astype(x.dtype)
    if kind == "frobenius":
        return (x32 / (fro_norm(x) + eps)).astype(x.dtype)
    sv = jnp.linalg.svd(x32, compute_uv=False)  # spectral: every caller has checked kind
    return (x32 / (jnp.max(sv, axis=-1)[..., None, None] + eps)).astype(x.dtype)


def preconditioned_step(x: jax.Array, abc: tuple[float, float, float], kind: str) -> jax.Array:
    """The first iteration with ``kind``'s scaling folded into its Gram matrix ``A = X X^T``:
    ``aol`` (Turbo-Muon, arXiv:2512.04632) ``D X``, ``D A D``, of spectral norm at most one
    (Gershgorin), often far below ``||X||_F``; ``schatten`` ``X / ||X||_S4``. Zero stays zero."""
    if x.shape[-2] > x.shape[-1]:
        return jnp.swapaxes(preconditioned_step(jnp.swapaxes(x, -1, -2), abc, kind), -1, -2)
    f32, dtype = jnp.float32, x.dtype
    gram = _matmul(x, jnp.swapaxes(x, -1, -2)).astype(f32)
    if kind == "aol":
        s = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(gram), axis=-1, keepdims=True), 1e-8))
        x, gram = x.astype(f32) * s, gram * s * jnp.swapaxes(s, -1, -2)
    else:  # schatten: polar_iteration's only other kind
        s = jax.lax.rsqrt(jnp.maximum(jnp.sqrt(jnp.sum(gram * gram, axis=(-2, -1),
                                                       keepdims=True)), 1e-8))
        x, gram = x.astype(f32) * s, gram * (s * s)
    return _matmul(_polynomial(gram.astype(dtype), *abc), x.astype(dtype))


def polar_iteration(x: jax.Array, coeffs: Coeffs, method: str = "direct", *,
                    preconditioning: str = "basin") -> jax.Array:
    """A step per row of ``coeffs`` on a preconditioned ``x``; ``method``: :func:`polar_express`."""
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
                        coeffs: Coeffs | None = None, preconditioning: str = "basin") -> jax.Array:
    """:func:`polar_express` (given ``coeffs``, :func:`polar_iteration`) on a stack ``(K, R, C)``:
    batched on accelerators, on CPU one matrix at a time (faster; only its temporaries alive)."""
    if coeffs is None:
        coeffs = ns_coefficients("polar_express", ns_steps, "polar_express")
    def batched(y):
        return polar_iteration(y, coeffs, method, preconditioning=preconditioning)
    if x.shape[0] <= 1:
        return batched(x)
    def one_by_one(y):
        if UNROLL_STEPS:
            return jnp.concatenate([batched(y[i:i + 1]) for i in range(y.shape[0])])
        return jax.lax.map(batched, y)
    return per_platform("polar", x, cpu=one_by_one, default=batched)


def orthogonalize(x: jax.Array, ns_steps: int = 5, *, compute_dtype: jnp.dtype | str | None = None,
                  method: str = "direct", ns_coeffs: Any = "polar_express",
                  preconditioning: str = "basin", eps: float = 1e-8) -> jax.Array:
    """Approximate polar factor of each matrix in ``x`` (..., R, C).

    Scales each matrix into the basin, ``X / (1.01 ||X||_F + 1e-6)``, then runs
    ``ns_steps`` Polar Express iterations in ``compute_dtype`` (default: float32 on CPU,
    bfloat16 on GPU/TPU), the result's dtype. A zero matrix stays zero. ``method``: see
    :func:`polar_express`; ``ns_coeffs`` (a preset of :data:`NS_COEFF_PRESETS`, a triple or
    an ``(n, 3)`` table) and ``preconditioning`` (:func:`precondition`): another iteration.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs (..., R, C) matrices, got shape {x.shape}.")
    coeffs = ns_coefficients(ns_coeffs, ns_steps, "orthogonalize")
    check_preconditioning(preconditioning, "orthogonalize")
    dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else default_compute_dtype()
    x = precondition(x.astype(dtype), preconditioning, eps)
    return polar_iteration(x, coeffs, method, preconditioning=preconditioning)
