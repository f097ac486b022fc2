"""The TPU's form of the one-device Muon phase: a stack's equal chunks run as one kernel
in a loop (``one_device._run_in_loop``), forced onto XLA:CPU through ``platform.FORCED``.

It must give the chunk-by-chunk form's numbers bit for bit, and the program must hold a
number of kernels that does not grow with the number of layers.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import muon_optax
from muon_optax.rule import platform
from muon_optax.step import one_device


def _params(layers, d=16, dtype=jnp.float32):
    keys = iter(jax.random.split(jax.random.PRNGKey(layers), 6 * layers + 1))
    params = {"embed": jax.random.normal(next(keys), (64, d))}
    for i in range(layers):
        for name, shape in (("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)),
                            ("fc", (d, 4 * d)), ("proj", (4 * d, d))):
            params[f"b{i}_{name}"] = (jax.random.normal(next(keys), shape) / d).astype(dtype)
    return params


def _tx(params, mixed=False):
    groups = {"adam": dict(kind="adamw", lr=1e-3, betas=(0.8, 0.95), eps=1e-10,
                           weight_decay=0.0),
              "m": dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95,
                        weight_decay=0.2, compute_dtype=jnp.float32)}
    if mixed:   # a second group in the same stacks: per-matrix momentum and beta2
        groups["m2"] = groups["m"] | dict(momentum=0.9, beta2=0.9, lr=0.01)

    def label(name):
        if name == "embed":
            return "adam"
        return "m2" if mixed and int(name[1:].split("_")[0]) % 2 else "m"
    return muon_optax.muon_adamw(groups, {k: label(k) for k in params})


@contextlib.contextmanager
def _looped(loop):
    """The TPU's form of the one-device step (chunks in loops) on XLA:CPU, if ``loop``."""
    old = dict(platform.FORCED)
    if loop:
        platform.FORCED["loop"] = "tpu"
    try:
        yield
    finally:
        platform.FORCED.clear()
        platform.FORCED.update(old)


def _run(params, tx, loop, steps=3, grad_dtype=None):
    with _looped(loop):
        step = jax.jit(tx.update)
        state, out = tx.init(params), []
        for t in range(steps):
            grads = jax.tree.map(lambda p, t=t: jnp.sin(p * (3.0 + t)) + 0.1 * p, params)
            if grad_dtype is not None:
                grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
            updates, state = step(grads, state, params)
            params = jax.tree.map(lambda p, u: p + u, params, updates)
            out.append(updates)
        return params, state, out


@pytest.mark.parametrize("case", ["plain", "mixed_groups", "adaptive", "ragged"])
def test_loop_is_the_chunked_form_bit_for_bit(case, monkeypatch):
    if case == "ragged":   # 5 layers in runs of 2 chunks: a last run of one chunk
        monkeypatch.setattr(one_device, "LOOP_CHUNKS", 2)
    params = _params(5 if case == "ragged" else 4)
    if case == "adaptive":   # optax's rule: <U, O> summed over each leaf
        tx = muon_optax.contrib_muon(0.02, adaptive=True, weight_decay=0.1)
    else:
        tx = _tx(params, mixed=case == "mixed_groups")
    want, got = _run(params, tx, False), _run(params, tx, True)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loop_with_gradients_in_another_dtype():
    params = _params(4)
    tx = _tx(params)
    want = _run(params, tx, False, grad_dtype=jnp.bfloat16)
    got = _run(params, tx, True, grad_dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _kernels(layers, loop):
    params = _params(layers)
    tx = _tx(params)
    with _looped(loop):
        text = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
    return len(re.findall(r"stablehlo\.dot_general", text)), text.count("stablehlo.while")


def test_kernels_do_not_grow_with_layers(monkeypatch):
    monkeypatch.setattr(one_device, "LOOP_CHUNKS", 64)
    # Three stacks (squares, fc, proj), each one kernel in a loop, for 2 or 8 layers.
    assert _kernels(2, True) == _kernels(8, True)
    # Chunk by chunk, the program grows with the layers.
    assert _kernels(8, False)[0] > _kernels(2, False)[0]
