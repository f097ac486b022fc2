"""A nanochat-like parameter set, its optimizer groups, and shared benchmark helpers.

The parameter tree mirrors the GPT of ``examples/gpt`` (nanochat's architecture without
value embeddings), as plain nested dicts of arrays::

    wte/embedding                  (vocab, d)                 AdamW "embed"
    blocks/{i}/attn/c_{q,k,v,proj}/kernel   (d, d)            Muon  "matrix"
    blocks/{i}/mlp/c_fc/kernel     (d, 4d)     Flax (in, out)  Muon
    blocks/{i}/mlp/c_proj/kernel   (4d, d)                    Muon
    lm_head/kernel                 (d, vocab)                 AdamW "lm_head"
    resid_lambdas, x0_lambdas      (n_layer,)                 AdamW "resid", "x0"

``layout="torch"`` gives the same values in PyTorch's layout: every ``kernel`` becomes a
``weight`` holding its transpose ``(out, in)`` (``lm_head/weight`` is ``(vocab, d)``).
Arrays are NumPy (``ml_dtypes.bfloat16`` for bf16) so that JAX and PyTorch contenders
can be fed identical numbers.

Usage::

    from benchmarks.params import nanochat_params, nanochat_groups, nanochat_labels
    params = jax.device_put(nanochat_params(256, 4, 4096, np.float32))
    tx = muon_optax.muon_adamw(nanochat_groups(256), nanochat_labels(params))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

import muon_optax

# nanochat's base_train defaults (see examples/gpt/optim_setup.py), as constants.
EMBEDDING_LR = 0.3
UNEMBEDDING_LR = 0.008
MATRIX_LR = 0.02
SCALAR_LR = 0.5
WEIGHT_DECAY = 0.28
ADAM_BETAS = (0.8, 0.95)
ADAM_EPS = 1e-10
REFERENCE_D_MODEL = 768

LABEL_RULES = (
    (r"^wte/", "embed"),
    (r"^lm_head/", "lm_head"),
    (r"^resid_lambdas", "resid"),
    (r"^x0_lambdas", "x0"),
    (r"^blocks/", "matrix"),
)

BLOCK_MATRICES = (("attn", "c_q"), ("attn", "c_k"), ("attn", "c_v"), ("attn", "c_proj"),
                  ("mlp", "c_fc"), ("mlp", "c_proj"))


def numpy_dtype(dtype: Any) -> np.dtype:
    """``np.float32`` / ``"bfloat16"`` / ``jnp.bfloat16`` ... as a NumPy dtype."""
    if str(jnp.dtype(dtype)) == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(jnp.dtype(dtype).name)


def block_shapes(n_embd: int) -> dict[tuple[str, str], tuple[int, int]]:
    """Flax ``(in, out)`` shapes of one block's matrices."""
    d = n_embd
    return {("attn", "c_q"): (d, d), ("attn", "c_k"): (d, d), ("attn", "c_v"): (d, d),
            ("attn", "c_proj"): (d, d), ("mlp", "c_fc"): (d, 4 * d),
            ("mlp", "c_proj"): (4 * d, d)}


def nanochat_params(n_embd: int = 256, n_layer: int = 4, vocab: int = 4096,
                    dtype: Any = np.float32, layout: str = "flax",
                    seed: int = 0, abstract: bool = False) -> dict[str, Any]:
    """The parameter tree (NumPy arrays), in ``"flax"`` or ``"torch"`` layout.

    Both layouts hold the same numbers for the same ``seed``: a torch ``weight`` is the
    transpose of the flax ``kernel``. Matrices are N(0, 1/fan_in), the embedding N(0, 1),
    the head N(0, 1e-3), the lambdas 1.0 and 0.1 (nanochat's init, except that the
    zero-initialised output projections get random values too, so that the cautious
    weight-decay mask is not trivially all-true). ``abstract=True`` returns
    ``jax.ShapeDtypeStruct`` leaves instead (shapes only, nothing allocated).
    """
    if layout not in ("flax", "torch"):
        raise ValueError(f"layout must be 'flax' or 'torch', got {layout!r}")
    rng = np.random.default_rng(seed)
    np_dtype = numpy_dtype(dtype)

    def normal(shape, std):
        if abstract:
            return jax.ShapeDtypeStruct(shape, np_dtype)
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np_dtype)

    def const(value):
        if abstract:
            return jax.ShapeDtypeStruct((n_layer,), np_dtype)
        return np.full((n_layer,), value, np_dtype)

    def linear(kernel):  # kernel is Flax (in, out)
        if layout == "flax":
            return {"kernel": kernel}
        if abstract:
            return {"weight": jax.ShapeDtypeStruct(kernel.shape[::-1], kernel.dtype)}
        return {"weight": np.ascontiguousarray(kernel.T)}

    blocks = {}
    for i in range(n_layer):
        block: dict[str, dict[str, Any]] = {"attn": {}, "mlp": {}}
        for (sub, name), (fan_in, fan_out) in block_shapes(n_embd).items():
            block[sub][name] = linear(normal((fan_in, fan_out), 1.0 / math.sqrt(fan_in)))
        blocks[i] = block
    return {
        "wte": {"embedding": normal((vocab, n_embd), 1.0)},
        "blocks": blocks,
        "lm_head": linear(normal((n_embd, vocab), 1e-3)),
        "resid_lambdas": const(1.0),
        "x0_lambdas": const(0.1),
    }


def random_grads(params: Any, seed: int = 1, scale: float = 1e-2) -> Any:
    """Random gradients shaped like ``params`` (NumPy, same dtypes)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: (rng.standard_normal(p.shape, dtype=np.float32) * scale).astype(p.dtype),
        params)


def to_torch_layout(tree: Any) -> Any:
    """A Flax-layout tree (NumPy) in PyTorch layout: ``kernel`` -> transposed ``weight``."""
    if isinstance(tree, Mapping):
        return {("weight" if k == "kernel" else k): (
            np.ascontiguousarray(v.T) if k == "kernel" else to_torch_layout(v))
            for k, v in tree.items()}
    return tree


def nanochat_groups(n_embd: int, *, compute_dtype: Any = None,
                    weight_decay: float = WEIGHT_DECAY) -> dict[str, dict[str, Any]]:
    """``muon_optax.muon_adamw`` groups with nanochat's (constant) hyperparameters."""
    scale = (n_embd / REFERENCE_D_MODEL) ** -0.5

    def adamw(lr, betas=ADAM_BETAS):
        return dict(kind="adamw", lr=lr, betas=betas, eps=ADAM_EPS, weight_decay=0.0)

    muon_options = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
    return {
        "lm_head": adamw(UNEMBEDDING_LR * scale),
        "embed": adamw(EMBEDDING_LR * scale),
        "resid": adamw(SCALAR_LR * 0.01),
        "x0": adamw(SCALAR_LR, betas=(0.96, 0.95)),
        "matrix": dict(kind="muon", lr=MATRIX_LR, momentum=0.95, ns_steps=5, beta2=0.95,
                       weight_decay=weight_decay, **muon_options),
    }


def nanochat_labels(params: Any) -> Any:
    """The group name of every leaf (a tree like ``params``, either layout)."""
    return muon_optax.label_by_path(LABEL_RULES, matrix="unmatched", other="unmatched")(params)


def torch_param_groups(named: Mapping[str, Any], groups: Mapping[str, Mapping[str, Any]],
                       labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """``TorchMuonAdamW`` param groups: ``named`` maps a path to its ``torch.nn.Parameter``.

    One Muon group holds every block matrix; the peer (like nanochat) stacks them by shape.
    """
    out = []
    for name, hp in groups.items():
        members = [p for path, p in named.items() if labels[path] == name]
        hp = {k: v for k, v in hp.items() if k != "compute_dtype"}
        out.append(dict(params=members, **hp))
    return out


def optax_contrib_muon(params: Any, *, weight_decay: float = WEIGHT_DECAY,
                       ns_steps: int = 5) -> optax.GradientTransformation:
    """``optax.contrib.muon`` set up as close to nanochat's rule as its options allow.

    Same Polar Express coefficients, one triple per iteration (``ns_coeffs`` given as
    the (5, 3) table: optax then runs a ``lax.scan`` over its rows), Nesterov momentum
    0.95, lr 0.02 with the ``sqrt(max(1, out/in))`` width factor, decoupled weight decay;
    Muon for the block matrices (Flax layout, ``MuonDimensionNumbers(0, 1)``), its AdamW
    (betas (0.8, 0.95)) for everything else. What it cannot express: per-group AdamW
    learning rates (one ``adam_learning_rate`` for all), MuonEq, Muon+ renormalisation,
    NorMuon, cautious weight decay, a bf16 compute dtype, and same-shape stacking (it
    orthogonalizes leaf by leaf). Its AdamW runs with the embedding's learning rate.
    """
    n_embd = params["wte"]["embedding"].shape[1]
    labels = nanochat_labels(params)
    dims = jax.tree.map(
        lambda label: optax.contrib.MuonDimensionNumbers(0, 1) if label == "matrix" else None,
        labels)
    return optax.contrib.muon(
        learning_rate=MATRIX_LR,
        ns_coeffs=muon_optax.POLAR_EXPRESS_COEFFS,
        ns_steps=ns_steps,
        beta=0.95,
        eps=ADAM_EPS,
        weight_decay=weight_decay,
        nesterov=True,
        adam_b1=ADAM_BETAS[0],
        adam_b2=ADAM_BETAS[1],
        adam_learning_rate=EMBEDDING_LR * (n_embd / REFERENCE_D_MODEL) ** -0.5,
        muon_weight_dimension_numbers=dims,
    )


# ----------------------------------------------------------------------------- polar inputs

def basin_scaled(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random float32 matrices ``(..., R, C)``, each scaled into the polar iteration's
    basin (``X / (1.01 ||X||_F)``), as the step hands them to Polar Express."""
    x = rng.standard_normal(shape, dtype=np.float32)
    return x / (1.01 * np.linalg.norm(x, axis=(-2, -1), keepdims=True))


def numpy_polar_express(x: np.ndarray) -> np.ndarray:
    """The 5 direct Polar Express steps on one wide or square matrix, in NumPy and in
    ``x``'s dtype: a float64 reference, or a BLAS contender (the a-term on the small side,
    ``(a I + b A + c A^2) X``, as the library computes it)."""
    for a, b, c in muon_optax.POLAR_EXPRESS_COEFFS:
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        poly[np.diag_indices_from(poly)] += a
        x = poly @ x
    return x


# ----------------------------------------------------------------------------- FLOPs

def polar_flops(rows: int, cols: int, ns_steps: int = 5) -> int:
    """Matmul FLOPs of Polar Express on one matrix, Gram on the short side.

    Per iteration, with ``R = min(rows, cols)`` and ``C = max``: ``2 R R C`` (Gram
    ``X X^T``) + ``2 R^3`` (``A @ A``) + ``2 R R C`` (``B @ X``).
    """
    r, c = min(rows, cols), max(rows, cols)
    return ns_steps * (4 * r * r * c + 2 * r ** 3)


def muon_matrix_shapes(params: Any) -> list[tuple[int, int]]:
    """The 2-D shapes of the Muon leaves of a nanochat tree (either layout)."""
    labels = jax.tree.leaves(nanochat_labels(params))
    return [tuple(p.shape) for p, label in zip(jax.tree.leaves(params), labels)
            if label == "matrix"]


def muon_flops(params: Any, ns_steps: int = 5) -> int:
    """Total Polar Express matmul FLOPs of one optimizer step on ``params``."""
    return sum(polar_flops(r, c, ns_steps) for r, c in muon_matrix_shapes(params))


def tree_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def per_shape_counts(shapes: Sequence[tuple[int, int]]) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    for s in shapes:
        counts[s] = counts.get(s, 0) + 1
    return counts
