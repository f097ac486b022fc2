"""A small ZeRO-2 problem shared by test_sharding.py, test_multihost.py and the worker.

Not collected (no ``test_`` prefix). Everything is deterministic: the gradient that
device ``d`` sees at step ``s`` depends only on ``(s, d)``, so a process can make its
own devices' rows without the others'.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import muon_optax

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from benchmarks.common import collectives, per_device_bytes  # noqa: E402,F401  (HLO parser)

# Muon: a (16, 32)-stored stack of K=5 mixing orientations (three (in=16, out=32) Flax
# kernels, stored transposed, and two (out=16, in=32) PyTorch-layout ones, DIMS) and
# two groups; a
# (24, 24) stack of K=3, two of them one scanned (2, in, out) leaf, whose matrices may
# land on different devices. AdamW: two large params with odd shapes (split and, for
# most N, padded), a small vector and a scalar (all-reduced, replicated).
SHAPES = {
    "blocks": {
        "w0": (16, 32), "w1": (16, 32), "w2": (16, 32),
        "t0": (16, 32), "t1": (16, 32),
        "q0": (24, 24), "q12": (2, 24, 24),
    },
    "embed": (97, 13),
    "head": (33, 40),
    "bias": (7,),
    "gain": (),
}
LABELS = {
    "blocks": {"w0": "muon", "w1": "muon", "w2": "muon2", "t0": "muon", "t1": "muon",
               "q0": "muon2", "q12": "muon2"},
    "embed": "adamw", "head": "adamw", "bias": "adamw", "gain": "adamw",
}
SMALL = ("bias", "gain")


def DIMS(params):
    """``t0`` and ``t1`` in PyTorch's (out, in) layout; the rest as Flax lays them out."""
    torch_layout = muon_optax.MuonDimensionNumbers(reduction_axis=1, output_axis=0)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: torch_layout if muon_optax.path_str(path) in ("blocks/t0", "blocks/t1")
        else None, params)           # under muon_optax's 1024-element threshold


def groups():
    """Two Muon groups and one AdamW group; most hyperparameters change every step."""
    return {
        "adamw": dict(kind="adamw", lr=optax.linear_schedule(0.01, 0.002, 10),
                      betas=(0.8, 0.95), eps=1e-10,
                      weight_decay=optax.cosine_decay_schedule(0.1, 10)),
        "muon": dict(kind="muon", lr=optax.linear_schedule(0.02, 0.005, 10),
                     momentum=optax.linear_schedule(0.85, 0.95, 10), ns_steps=5,
                     beta2=optax.linear_schedule(0.9, 0.95, 10), weight_decay=0.2,
                     compute_dtype=jnp.float32),
        "muon2": dict(kind="muon", lr=0.01, momentum=0.9, ns_steps=5, beta2=0.95,
                      weight_decay=0.1, compute_dtype=jnp.float32),
    }


def is_shape(x):
    return isinstance(x, tuple)


def _normal(seed, shape, dtype):
    x = 0.5 * np.random.default_rng(seed).standard_normal(shape)
    return x.astype(dtype)


def _leaf_seeds():
    paths = [muon_optax.path_str(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(SHAPES, is_leaf=is_shape)[0]]
    return jax.tree.unflatten(jax.tree.structure(SHAPES, is_leaf=is_shape), range(len(paths)))


def make_params(dtype=np.float32):
    return jax.tree.map(lambda s, i: _normal((0, i), s, dtype), SHAPES, _leaf_seeds(),
                        is_leaf=is_shape)


def _coarse(seed, shape, dtype):
    """Multiples of 1/16 in [-2, 2]: a sum of up to 8 is exact in bfloat16."""
    x = np.clip(np.round(_normal(seed, shape, np.float64) * 16) / 16, -2, 2)
    return x.astype(dtype)


def device_grads(step, devices, dtype=np.float32):
    """Per-device gradients at ``step`` for the device indices ``devices``: leaves
    ``(len(devices), *shape)``.

    bfloat16 gradients are coarse (see ``_coarse``), so that the devices' sum is exact
    and the sharded mean equals the single-device mean: with general bfloat16 values the
    reduction's rounding (2^-8) alone moves a Muon update by ~10%, and a comparison
    could only catch gross errors.
    """
    make = _coarse if np.dtype(dtype) == np.dtype(jnp.bfloat16) else _normal
    return jax.tree.map(
        lambda s, i: np.stack([make((1 + step, d, i), s, dtype) for d in devices]),
        SHAPES, _leaf_seeds(), is_leaf=is_shape)


def mean_grads(stacked, dtype):
    """The mean over devices in float64, rounded once to ``dtype``."""
    return jax.tree.map(lambda g: np.mean(np.asarray(g, np.float64), 0).astype(dtype), stacked)


def make_mesh(shape, names=("data",)):
    n = math.prod(shape)
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                         devices=jax.devices()[:n])


def sharded_fns(tx, params, mesh, axis="data"):
    """``(init, step, specs)``: jitted shard_map'd init and train step.

    ``step(params, state, grads)`` takes the per-device gradients stacked along a
    leading axis of length N (sharded over ``axis``) and returns ``(params, state)``.
    """
    specs = muon_optax.state_specs(tx, params, mesh)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def step(params, state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)      # this device's own gradient
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(axis)),
                                 out_specs=(P(), specs)))
    return init, step, specs


def fsdp_specs(params, n):
    """Each >= 2-D leaf split over "data" along its first axis that ``n`` divides."""
    def spec(x):
        for a, d in enumerate(x.shape):
            if x.ndim >= 2 and d % n == 0:
                return P(*([None] * a), "data")
        return P()
    return jax.tree.map(spec, params)


def make_tx(axis_name="data"):
    return muon_optax.muon_adamw(groups(), LABELS, axis_name=axis_name, dimension_numbers=DIMS)


# Cheaper LLVM code generation: the optimized HLO (collectives, fusions) is the same, and
# the sharding tests are dominated by compile time. Each program compiles once a session.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def jit_steps(tx, mesh, specs, n, steps=2):
    """``steps`` steps of ``tx`` (update + apply) under jit on ``mesh``, params and
    gradients placed by ``specs`` (a tree of PartitionSpecs like the params), every
    device given the same gradient (the mean of ``n`` devices'): the params and state
    after each step (numpy), the jitted step and its last arguments."""
    from jax.sharding import NamedSharding

    def put(tree):
        return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)

    def apply(p, st, g):
        u, st = tx.update(g, st, p)
        return optax.apply_updates(p, u), st

    step = jax.jit(apply, compiler_options=FAST_COMPILE)
    p = put(make_params())
    state, out = jax.jit(tx.init)(p), []
    for s in range(steps):
        g = put(mean_grads(device_grads(s, range(n)), np.float32))
        p, state = step(p, state, g)
        out.append(jax.tree.map(np.asarray, (p, state)))
    return out, step, (p, state, g)


class Sharded(NamedTuple):
    mesh: jax.sharding.Mesh
    init: Callable          # params -> sharded state
    step: Callable          # (params, state, per-device grads (N, ...)) -> (params, state)
    specs: Any
    hlo: str                # the compiled step's optimized HLO


def sharded(mesh_shape, names=("data",), dtype=np.float32):
    """The shared problem's sharded init and compiled train step on a mesh."""
    return _sharded(tuple(mesh_shape), tuple(names), np.dtype(dtype))


@functools.cache
def _sharded(mesh_shape, names, dtype):
    mesh = make_mesh(mesh_shape, names)
    params = make_params(dtype)
    init, step, specs = sharded_fns(make_tx("data"), params, mesh)
    grads = device_grads(0, range(mesh.shape["data"]), dtype)
    compiled = step.lower(params, init(params), grads).compile(FAST_COMPILE)
    return Sharded(mesh, init, compiled, specs, compiled.as_text())


def single_update(dtype):
    """The single-device (no axis_name) update, compiled."""
    return _single_update(np.dtype(dtype))


@functools.cache
def _single_update(dtype):
    tx = make_tx(None)
    params = make_params(dtype)
    return jax.jit(tx.update).lower(params, tx.init(params), params).compile(FAST_COMPILE)


def nanochat_like(n_embd=64, n_layer=4, vocab=512):
    """nanochat's shapes in Flax (in, out) layout."""
    layer = {"attn": {k: (n_embd, n_embd) for k in ("c_q", "c_k", "c_v", "c_proj")},
             "mlp": {"c_fc": (n_embd, 4 * n_embd), "c_proj": (4 * n_embd, n_embd)}}
    shapes = {"wte": (vocab, n_embd), "lm_head": (n_embd, vocab),
              "blocks": {str(i): layer for i in range(n_layer)},
              "resid_lambdas": (n_layer,), "x0_lambdas": (n_layer,), "logit_scale": ()}
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes,
                          is_leaf=is_shape)
    labels = muon_optax.label_by_path([("wte", "embed"), ("lm_head", "head"),
                                       ("lambdas|scale", "scalars")], matrix="matrix")
    groups = {
        "embed": dict(kind="adamw", lr=0.2, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0),
        "head": dict(kind="adamw", lr=0.004, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0),
        "scalars": dict(kind="adamw", lr=0.5, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0),
        "matrix": dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95,
                       weight_decay=0.2),
    }
    return params, labels, groups


def tiny_lm():
    """A tiny LM's params (embedding, two matrices, a gain), its groups and labels: the
    tests that take jax.grad inside shard_map train it."""
    rng = np.random.default_rng(0)
    params = {"embed": (rng.standard_normal((64, 32)) / 8).astype(np.float32),
              "w1": (rng.standard_normal((32, 64)) / 8).astype(np.float32),
              "w2": (rng.standard_normal((64, 32)) / 8).astype(np.float32),
              "gain": np.ones(32, np.float32)}
    groups = {"adamw": dict(kind="adamw", lr=3e-3, betas=(0.8, 0.95), eps=1e-10,
                            weight_decay=0.0),
              "muon": dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95,
                           weight_decay=0.1, compute_dtype=jnp.float32)}
    labels = muon_optax.label_by_path([("embed", "adamw")])
    return params, groups, labels


def tiny_lm_loss(params, tokens):
    """:func:`tiny_lm`'s loss: embed, a residual MLP, reconstruct the embedding."""
    h = params["embed"][tokens] * params["gain"]
    return jnp.mean((jax.nn.relu(h @ params["w1"]) @ params["w2"] - h) ** 2)


# Every site with a TPU form but "polar" (CPU: a form of its own), for the tests that force
# them all on XLA:CPU through muon_optax.rule.platform.FORCED.
TPU_SITES = ("exchange", "gather", "scatter", "order", "late_adamw", "tiles", "loop",
             "remainder")


def lower_all_gather_limit(m, limit: int) -> list[int]:
    """The all-gather device limit set to ``limit`` through ``m`` (a pytest ``MonkeyPatch``),
    so that a few CPU devices take the TPU forms past it; returns the list into which each
    :meth:`GatherSink._by_groups` call puts its group size."""
    from muon_optax.step import collectives as step_collectives
    from muon_optax.step import transport

    m.setattr(step_collectives, "ALL_GATHER_MAX_DEVICES", limit)
    m.setattr(transport, "ALL_GATHER_MAX_DEVICES", limit)
    groups, by_groups = [], transport.GatherSink._by_groups
    m.setattr(transport.GatherSink, "_by_groups",
              lambda self, b, g: groups.append(g) or by_groups(self, b, g))
    return groups
