"""What the optimizer does: orthogonal steps, determinism, convergence, no retracing, dtypes."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax

try:
    from .test_optimizer import adamw_group, muon_group
except ImportError:  # plain `pytest` rootdir imports
    from test_optimizer import adamw_group, muon_group

def random_tree(shapes, seed=0, dtype=jnp.float32):
    """Like test_optimizer.random_tree, from numpy: no per-shape compile of jax.random."""
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(0.5 * rng.standard_normal(s, np.float32), dtype)
            for k, s in sorted(shapes.items())}


def gaussian(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def conditioned(seed, shape, cond=30.0):
    """Random matrices ``(..., R, C)`` whose singular values span ``[1/cond, 1]`` (log-even).

    A square Gaussian matrix may be nearly singular, which no five-step polynomial lifts to
    one; a known spectrum makes the band check meaningful for every shape.
    """
    *batch, r, c = shape
    k = min(r, c)
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((*batch, r, k)))
    v, _ = np.linalg.qr(rng.standard_normal((*batch, c, k)))
    s = np.logspace(-np.log10(cond), 0, k)
    return jnp.asarray((u * s) @ np.swapaxes(v, -1, -2), jnp.float32)


@functools.partial(jax.jit, static_argnums=1)
def orthogonalize(x, ns_steps=5):
    return muon_optax.orthogonalize(x, ns_steps, compute_dtype=jnp.float32)


def singular_values(x):
    return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)


SHAPES = {"wide": (16, 48), "tall": (48, 16), "square": (32, 32), "batched": (4, 24, 40),
          "batched_tall": (3, 40, 24)}


# ----------------------------------------------------------------------------- orthogonalize

@pytest.mark.parametrize("name", sorted(SHAPES))
def test_orthogonalize_is_near_semi_orthogonal(name):
    x = conditioned(0, SHAPES[name])
    o = orthogonalize(x)
    assert o.shape == x.shape and o.dtype == jnp.float32
    s = singular_values(o)
    assert s.min() > 0.6 and s.max() < 1.2, (s.min(), s.max())
    # The input was far from orthogonal: the check measures the iteration.
    assert singular_values(x).min() < 0.05


@pytest.mark.parametrize("name", ["wide", "tall", "batched"])
def test_orthogonalize_gaussian_is_near_semi_orthogonal(name):
    s = singular_values(orthogonalize(gaussian(1, SHAPES[name])))
    assert s.min() > 0.6 and s.max() < 1.2, (s.min(), s.max())


def test_fewer_ns_steps_are_less_orthogonal():
    x = conditioned(0, (32, 64), cond=100.0)
    spread = [np.ptp(singular_values(orthogonalize(x, n))) for n in range(1, 6)]
    assert spread[-1] < 0.35 and spread[0] > spread[-1], spread


def test_orthogonalize_keeps_zero_zero():
    for shape in [(8, 16), (16, 8), (3, 12, 12)]:
        o = orthogonalize(jnp.zeros(shape))
        np.testing.assert_array_equal(o, np.zeros(shape))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_orthogonalize_commutes_with_transpose(name):
    x = gaussian(2, SHAPES[name])
    t = lambda a: jnp.swapaxes(a, -1, -2)  # noqa: E731
    o, o_t = orthogonalize(x), orthogonalize(t(x))
    np.testing.assert_allclose(o_t, t(o), rtol=0, atol=2e-5)


@pytest.mark.parametrize("opts", [dict(row_equilibration=False, renormalize=False), {}],
                         ids=["plain", "default"])
def test_first_muon_update_is_near_semi_orthogonal(opts):
    # Step 1: the Nesterov momentum is a multiple of G, NorMuon's buffer is (1 - beta2) v,
    # so its rescaling only evens out row (or column) norms: the step stays near the polar
    # factor of G, times lr and the aspect factor.
    lr = 0.1
    tx = muon_optax.muon(lr, momentum=0.95, beta2=0.95, weight_decay=0.0,
                         compute_dtype=jnp.float32, **opts)
    names = ["wide", "tall", "batched", "batched_tall"]
    g = {name: gaussian(3 + i, SHAPES[name]) for i, name in enumerate(names)}
    u, _ = jax.jit(tx.update)(g, tx.init(g), g)
    for name in names:
        o = -np.swapaxes(np.asarray(u[name]), -1, -2) / lr  # Flax (in, out) -> (out, in)
        rows, cols = o.shape[-2:]
        s = singular_values(o / np.sqrt(max(1.0, rows / cols)))
        assert s.min() > 0.6 and s.max() < 1.3, (name, s.min(), s.max())


def test_polar_express_coefficients_reach_their_error_bound():
    # Polar Express (arXiv:2505.16932) picks each of its five odd quintics minimax-optimal
    # in turn, so the composition maps every singular value in [1e-3, 1] into 1 +- 0.1411
    # and reaches both ends (it equioscillates): an edited or truncated table does not.
    table = np.asarray(muon_optax.POLAR_EXPRESS_COEFFS, np.float64)
    assert table.shape == (5, 3)
    x = np.geomspace(1e-3, 1.0, 20001)
    for a, b, c in table:
        x = a * x + b * x**3 + c * x**5
    assert np.abs(x - 1).max() < 0.1412
    np.testing.assert_allclose(1 - x.min(), x.max() - 1, atol=1e-6)


# ----------------------------------------------------------------------------- whole optimizer

# One Muon stack of four (16, 32) matrices in both orientations, two AdamW leaves.
MIXED = {"a": (16, 32), "b": (32, 16), "d": (2, 16, 32), "v": (16,), "s": ()}


def mixed_tx(**muon_kw):
    return muon_optax.muon_adamw({"m": muon_group(**muon_kw), "a": adamw_group()},
                                 muon_optax.label_by_path(matrix="m", other="a"))


def run_steps(tx, steps, dtype=jnp.float32):
    params = random_tree(MIXED, dtype=dtype)
    state = tx.init(params)
    update = jax.jit(tx.update)
    history = []
    for step in range(steps):
        updates, state = update(random_tree(MIXED, 100 + step, dtype), state, params)
        params = optax.apply_updates(params, updates)
        history.append((updates, params, state))
    return history


def test_two_runs_are_bitwise_identical():
    first = run_steps(mixed_tx(), 5)
    second = run_steps(mixed_tx(), 5)  # a fresh transformation and compilation
    chex.assert_trees_all_equal(first, second)


def test_distance_to_target_converges():
    steps = 200
    shapes = {"a": (16, 32), "b": (32, 16), "c": (24, 24), "v": (16,), "s": ()}
    groups = {
        "m": dict(kind="muon", lr=optax.cosine_decay_schedule(0.1, steps), momentum=0.9,
                  ns_steps=5, beta2=0.95, weight_decay=0.0, compute_dtype=jnp.float32),
        "a": dict(kind="adamw", lr=optax.cosine_decay_schedule(0.05, steps), betas=(0.9, 0.99),
                  eps=1e-8, weight_decay=0.0),
    }
    tx = muon_optax.muon_adamw(groups, muon_optax.label_by_path(matrix="m", other="a"))
    params, target = random_tree(shapes, 0), random_tree(shapes, 1)

    def losses(p):
        return {k: 0.5 * jnp.sum((p[k] - target[k]) ** 2) for k in p}

    @jax.jit
    def train(params):
        def body(carry, _):
            p, s = carry
            loss, g = jax.value_and_grad(lambda p: sum(losses(p).values()))(p)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), loss
        (params, _), trace = jax.lax.scan(body, (params, tx.init(params)), length=steps)
        return params, trace

    before = {k: float(v) for k, v in losses(params).items()}
    params, trace = train(params)
    after = {k: float(v) for k, v in losses(params).items()}
    assert np.all(np.isfinite(trace))
    assert sum(after.values()) < 1e-2 * sum(before.values()), (before, after)
    for k in shapes:  # every leaf, Muon and AdamW alike
        assert after[k] < 1e-2 * before[k], (k, before[k], after[k])


def test_schedules_do_not_retrace():
    tx = mixed_tx()  # lr, momentum, beta2 (Muon) and lr, weight_decay (AdamW) are schedules
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)  # runs once per trace
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    params = random_tree(MIXED)
    state = tx.init(params)
    grads = random_tree(MIXED, 1)
    seen = []
    for _ in range(20):
        params, state, updates = step(params, state, grads)
        seen.append(float(jnp.abs(updates["v"]).max()))
    assert len(traces) == 1
    assert int(state.count) == 20
    # The schedules did move: AdamW's first steps are about lr = 0.01 -> 0.002 at step 10.
    assert seen[0] > 2 * seen[12], seen


def test_bf16_params_keep_bf16_state_and_track_f32():
    tx = mixed_tx()
    p32 = random_tree(MIXED, dtype=jnp.bfloat16)
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), p32)  # the same values in f32
    g32 = jax.tree.map(lambda x: x.astype(jnp.float32), random_tree(MIXED, 1, jnp.bfloat16))
    p16, g16 = (jax.tree.map(lambda x: x.astype(jnp.bfloat16), t) for t in (p32, g32))

    state16 = tx.init(p16)
    for leaf in jax.tree.leaves((state16.mu, state16.nu, state16.muon)):
        assert leaf.dtype == jnp.bfloat16
    assert state16.count.dtype == jnp.int32
    u16, state16 = jax.jit(tx.update)(g16, state16, p16)
    for leaf in jax.tree.leaves((u16, state16.mu, state16.nu, state16.muon)):
        assert leaf.dtype == jnp.bfloat16
    assert optax.apply_updates(p16, u16)["a"].dtype == jnp.bfloat16

    # The bf16 update is the change of the bf16 params (the new params rounded once), so
    # compare new params: within the bf16 step's error plus a rounding of the params.
    u32, _ = jax.jit(tx.update)(g32, tx.init(p32), p32)
    new16 = optax.apply_updates(p16, u16)
    for k in MIXED:
        got, want = np.asarray(new16[k], np.float32), np.asarray(p32[k] + u32[k])
        rounding = np.linalg.norm(want) * 2.0**-8      # half a bf16 ulp, relative
        err = np.linalg.norm(got - want)
        assert err <= 2e-2 * np.linalg.norm(u32[k]) + rounding, (k, err, rounding)


def test_scanned_leaf_equals_separate_leaves():
    layers = 3
    shapes = {"wide": (16, 32), "tall": (48, 16)}
    stacked = {k: (layers, *s) for k, s in shapes.items()}
    labels = muon_optax.label_by_path(matrix="m", other="a")
    tx = muon_optax.muon_adamw({"m": muon_group(), "a": adamw_group()}, labels)

    def split(tree):  # {"wide": (L, i, o)} -> {"wide0": (i, o), ...}
        return {f"{k}{i}": v[i] for k, v in tree.items() for i in range(layers)}

    p_scan = random_tree(stacked)
    p_sep = split(p_scan)
    s_scan, s_sep = tx.init(p_scan), tx.init(p_sep)
    update = jax.jit(tx.update)
    for step in range(4):
        g_scan = random_tree(stacked, 100 + step)
        u_scan, s_scan = update(g_scan, s_scan, p_scan)
        u_sep, s_sep = update(split(g_scan), s_sep, p_sep)
        chex.assert_trees_all_equal(split(u_scan), u_sep)
        p_scan = optax.apply_updates(p_scan, u_scan)
        p_sep = optax.apply_updates(p_sep, u_sep)
    chex.assert_trees_all_equal(split(p_scan), p_sep)
    assert [s["size"] for s in tx.init.stack_info(p_scan)] == \
        [s["size"] for s in tx.init.stack_info(p_sep)]
