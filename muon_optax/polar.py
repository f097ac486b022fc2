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

import jax
import jax.numpy as jnp

# Polar Express coefficients for 5 iterations (safety factor 2e-2, cushion 2), as given
# in the paper and used by nanochat. Iteration k uses the k-th triple (a, b, c).
POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def default_compute_dtype() -> jnp.dtype:
    """bfloat16 on accelerators, float32 on CPU (where bf16 matmuls are slow)."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def check_ns_steps(ns_steps: object, where: str = "orthogonalize") -> int:
    """``ns_steps`` is a static Python int in 1..5: it sets the program's length."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        raise TypeError(f"{where}: ns_steps must be a Python int in 1..5, got {ns_steps!r}.")
    if not 1 <= ns_steps <= len(POLAR_EXPRESS_COEFFS):
        raise ValueError(
            f"{where}: ns_steps={ns_steps} is outside 1..{len(POLAR_EXPRESS_COEFFS)}; Polar "
            f"Express has coefficients for {len(POLAR_EXPRESS_COEFFS)} iterations.")
    return ns_steps


def fro_norm(x: jax.Array) -> jax.Array:
    """Frobenius norm of each matrix over the last two axes, in float32, keepdims."""
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    # float32 means true float32: without HIGHEST, GPUs may run TF32 matmuls.
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.matmul(a, b, precision=precision)


def polar_flops(rows: int, cols: int, ns_steps: int, method: str) -> int:
    """Matmul FLOPs of :func:`polar_express` on one ``rows x cols`` matrix."""
    r, c = min(rows, cols), max(rows, cols)
    if method == "direct":  # per step: Gram, A @ A, B @ X
        return ns_steps * (4 * r * r * c + 2 * r**3)
    # gram: X X^T and the final Q X, plus per step A @ A, M @ Q (not the first) and
    # M A M (not the last)
    steps = ns_steps * 2 + (ns_steps - 1) * 2 + (ns_steps - 1) * 4
    return 4 * r * r * c + steps * r**3


def choose_method(rows: int, cols: int, ns_steps: int, method: str = "auto") -> str:
    """``auto`` picks the iteration with fewer FLOPs for this shape."""
    if method not in ("auto", "direct", "gram"):
        raise ValueError(f"polar method must be 'auto', 'direct' or 'gram', got {method!r}.")
    if method != "auto":
        return method
    gram = polar_flops(rows, cols, ns_steps, "gram")
    return "gram" if gram < polar_flops(rows, cols, ns_steps, "direct") else "direct"


def _polar_in_gram_space(x: jax.Array, ns_steps: int) -> jax.Array:
    """The same iteration, carried out on the short side's ``r x r`` matrices.

    Every iterate is ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``A_0 = X_0 X_0^T``
    (wide ``x``), so all of ``Q_k``, ``A_k = X_k X_k^T = Q_k^2 A_0`` and
    ``M_k = a I + b A_k + c A_k^2`` commute, and ``X_{k+1} = M_k X_k`` gives
    ``Q_{k+1} = M_k Q_k`` and ``A_{k+1} = M_k A_k M_k``. Only the first Gram matrix and
    the final ``Q X_0`` touch the long side: for a 4:1 matrix about 1.8x fewer FLOPs.
    """
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    eye = jnp.eye(x.shape[-2], dtype=x.dtype)
    gram = _matmul(x, jnp.swapaxes(x, -1, -2))
    q = None
    for k, (a, b, c) in enumerate(POLAR_EXPRESS_COEFFS[:ns_steps]):
        m = a * eye + b * gram + c * _matmul(gram, gram)
        q = m if q is None else _matmul(m, q)
        if k + 1 < ns_steps:
            gram = _matmul(m, _matmul(gram, m))
    x = _matmul(q, x)
    return jnp.swapaxes(x, -1, -2) if tall else x


def polar_express(x: jax.Array, ns_steps: int = 5, method: str = "direct") -> jax.Array:
    """Runs the first ``ns_steps`` Polar Express iterations on ``x`` (..., R, C) as is.

    ``x`` must already be scaled so that its spectral norm is at most one (see
    :func:`orthogonalize`). The arithmetic stays in ``x.dtype``. ``method``:
    ``"direct"`` iterates on ``X`` as written in the rule; ``"gram"`` iterates on the
    short side's Gram matrix (the same function, other rounding; fewer FLOPs for
    rectangular matrices); ``"auto"`` picks the cheaper.
    """
    check_ns_steps(ns_steps, "polar_express")
    if choose_method(x.shape[-2], x.shape[-1], ns_steps, method) == "gram":
        return _polar_in_gram_space(x, ns_steps)
    tall = x.shape[-2] > x.shape[-1]
    # a X + (b A + c A^2) X is computed as (a I + b A + c A^2) X: the a-term goes on the
    # small Gram side, saving a pass over the long side per step.
    eye = jnp.eye(min(x.shape[-2:]), dtype=x.dtype)
    for a, b, c in POLAR_EXPRESS_COEFFS[:ns_steps]:
        if tall:  # Gram on the short (column) side: A = X^T X, X (a I + b A + c A^2)
            gram = _matmul(jnp.swapaxes(x, -1, -2), x)
            x = _matmul(x, a * eye + b * gram + c * _matmul(gram, gram))
        else:  # wide or square: A = X X^T, (a I + b A + c A^2) X
            gram = _matmul(x, jnp.swapaxes(x, -1, -2))
            x = _matmul(a * eye + b * gram + c * _matmul(gram, gram), x)
    return x


def orthogonalize(
    x: jax.Array,
    ns_steps: int = 5,
    *,
    compute_dtype: jnp.dtype | str | None = None,
    method: str = "direct",
) -> jax.Array:
    """Approximate polar factor of each matrix in ``x`` (..., R, C).

    Scales each matrix into the iteration's basin, ``X / (1.01 ||X||_F + 1e-6)``, then
    runs ``ns_steps`` Polar Express iterations in ``compute_dtype`` (default: float32 on
    CPU, bfloat16 on GPU/TPU). Returns the result in ``compute_dtype``. A zero matrix
    stays zero. ``method`` as in :func:`polar_express`.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs (..., R, C) matrices, got shape {x.shape}.")
    dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else default_compute_dtype()
    x = x.astype(dtype)
    x = x / (1.01 * fro_norm(x) + 1e-6).astype(dtype)
    return polar_express(x, ns_steps, method)
