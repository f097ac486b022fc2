"""muon_adamw as a good optax citizen: wrappers, Flax, donation, checkpoints, optax parity."""

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state

import muon_optax

try:
    from .test_optimizer import adamw_group, muon_group
except ImportError:  # plain `pytest` rootdir imports
    from test_optimizer import adamw_group, muon_group

SHAPES = {"w1": (16, 32), "w2": (32, 16), "w3": (16, 32), "b": (16,), "s": ()}
LABELS = {"w1": "m", "w2": "m", "w3": "m", "b": "a", "s": "a"}


def random_tree(shapes, seed=0, dtype=jnp.float32):
    """Like test_optimizer.random_tree, from numpy: no per-shape compile of jax.random."""
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(0.5 * rng.standard_normal(s, np.float32), dtype)
            for k, s in sorted(shapes.items())}


def make_tx(**muon_kw):
    return muon_optax.muon_adamw({"m": muon_group(**muon_kw), "a": adamw_group()}, LABELS)


def step_fn(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


# One transformation and its compiled programs, shared by the tests (CPU compiles are slow).
TX = make_tx()
UPDATE = jax.jit(TX.update)
STEP = jax.jit(step_fn(TX))


@functools.cache
def grads_at(step, scale=1.0):
    return jax.tree.map(lambda g: scale * g, random_tree(SHAPES, seed=100 + step))


def run(steps, grads_fn=grads_at, params=None, step=STEP, tx=TX):
    params = random_tree(SHAPES) if params is None else params
    state = tx.init(params)
    for i in range(steps):
        params, state = step(params, state, grads_fn(i))
    return params, state


def assert_trees_differ(a, b, min_rel=1e-3):
    diff = max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert diff > min_rel, f"trees agree to {diff:.1e}: the check could not fail"


# ----------------------------------------------------------------------------- wrappers

def test_clip_by_global_norm_chain_equals_clipping_by_hand():
    # Scales vary per step, so the clip factor varies and changes the momentum mix.
    scales = [30.0, 3.0, 100.0, 10.0]
    grads_fn = lambda step: grads_at(step, scales[step])  # noqa: E731

    def clip(g):
        norm = jnp.sqrt(sum(jnp.sum(t * t) for t in jax.tree.leaves(g)))
        assert norm > 1.0  # the clip is active
        return jax.tree.map(lambda t: t / norm, g)

    chain = optax.chain(optax.clip_by_global_norm(1.0), TX)
    chained, _ = run(4, grads_fn, step=jax.jit(step_fn(chain)), tx=chain)
    by_hand, _ = run(4, lambda step: clip(grads_fn(step)))
    unclipped, _ = run(4, grads_fn)
    chex.assert_trees_all_close(chained, by_hand, rtol=1e-6, atol=1e-7)
    assert_trees_differ(unclipped, by_hand)


def test_multisteps_equals_tx_on_mean_of_micro_grads():
    k = 2
    ms = optax.MultiSteps(TX, every_k_schedule=k)
    params0 = random_tree(SHAPES)
    params, ms_state = params0, ms.init(params0)
    ms_update = jax.jit(ms.update)
    for micro in range(2 * k):
        updates, ms_state = ms_update(grads_at(micro), ms_state, params)
        if micro % k != k - 1:  # accumulating: no change
            chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
        params = optax.apply_updates(params, updates)

    def mean_grads(step):
        micro = [grads_at(k * step + i) for i in range(k)]
        return jax.tree.map(lambda *g: sum(g) / k, *micro)

    want, want_state = run(2, mean_grads, params0)
    chex.assert_trees_all_close(params, want, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(ms_state.inner_opt_state, want_state, rtol=1e-6, atol=1e-7)
    assert int(ms_state.inner_opt_state.count) == 2


def test_apply_if_finite_skips_nan_step_bitwise():
    tx = optax.apply_if_finite(TX, max_consecutive_errors=3)
    params = random_tree(SHAPES)
    state = tx.init(params)
    update = jax.jit(tx.update)
    # One good step so the inner state is not all zeros.
    updates, state = update(grads_at(0), state, params)
    params = optax.apply_updates(params, updates)

    bad = dict(grads_at(1))  # a copy: grads_at is cached
    bad["w1"] = bad["w1"].at[3, 5].set(jnp.nan)
    updates, new_state = update(bad, state, params)
    new_params = optax.apply_updates(params, updates)
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    assert int(new_state.notfinite_count) == 1 and not bool(new_state.last_finite)

    updates, after = update(grads_at(2), new_state, new_params)
    assert int(after.notfinite_count) == 0 and int(after.inner_state.count) == 2
    assert_trees_differ(optax.apply_updates(new_params, updates), new_params)
    # The skipped step left no trace: same as the inner tx on the good grads alone.
    _, inner_state = UPDATE(grads_at(0), TX.init(random_tree(SHAPES)), random_tree(SHAPES))
    want, _ = UPDATE(grads_at(2), inner_state, new_params)
    chex.assert_trees_all_close(updates, want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- flax

NNX_GROUPS = {
    "muon": dict(kind="muon", lr=0.02, momentum=0.9, ns_steps=5, beta2=0.95, weight_decay=0.0,
                 compute_dtype=jnp.float32),
    "head": dict(kind="adamw", lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0),
    "adamw": dict(kind="adamw", lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0),
}


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 16, rngs=rngs)
        self.l3 = nnx.Linear(16, 2, use_bias=False, rngs=rngs)
        self.scale = nnx.Param(jnp.ones(()))

    def __call__(self, x):
        h = jax.nn.tanh(self.l1(x))
        h = jax.nn.tanh(self.l2(h))
        return self.l3(h) * self.scale


def regression_data():
    x = jax.random.normal(jax.random.PRNGKey(1), (128, 4))
    y = jnp.sin(x @ jax.random.normal(jax.random.PRNGKey(2), (4, 2)))
    return x, y


def flat_labels_by_path(labels_fn, tree):
    flat = jax.tree_util.tree_flatten_with_path(labels_fn(tree))[0]
    return {muon_optax.path_str(p): label for p, label in flat}


def test_nnx_optimizer_trains_and_labels_by_path():
    model = NnxModel(nnx.Rngs(0))
    labels = muon_optax.label_by_path([("l3", "head")])
    # nnx state paths carry the Variable's "value" attribute; unanchored rules still match.
    got = flat_labels_by_path(labels, nnx.state(model, nnx.Param))
    assert {k.removesuffix("/value"): v for k, v in got.items()} == {
        "l1/kernel": "muon", "l1/bias": "adamw", "l2/kernel": "muon", "l2/bias": "adamw",
        "l3/kernel": "head", "scale": "adamw"}

    tx = muon_optax.muon_adamw(NNX_GROUPS, labels)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    stacked = [m for s in tx.init.stack_info(nnx.state(model, nnx.Param)) for m in s["members"]]
    assert sorted(p.removesuffix("/value") for p in stacked) == ["l1/kernel", "l2/kernel"]
    x, y = regression_data()

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer)) for _ in range(30)]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    assert int(optimizer.opt_state.count[...]) == 30


def test_nnx_anchored_rule_labels_init_and_update_alike():
    model = NnxModel(nnx.Rngs(0))
    labels = muon_optax.label_by_path([(r"^l3/kernel$", "head")])
    at_init = flat_labels_by_path(labels, nnx.state(model, nnx.Param))
    at_update = flat_labels_by_path(labels, nnx.as_pure(nnx.state(model, nnx.Param)))
    assert sorted(at_init.values()) == sorted(at_update.values())
    optimizer = nnx.Optimizer(model, muon_optax.muon_adamw(NNX_GROUPS, labels), wrt=nnx.Param)
    x, y = regression_data()
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.nn.tanh(nn.Dense(32)(x))
        h = jax.nn.tanh(nn.Dense(16)(h))
        return nn.Dense(2)(h) * self.param("scale", nn.initializers.ones, ())


def test_linen_train_state_trains():
    model = LinenMLP()
    x, y = regression_data()
    params = model.init(jax.random.PRNGKey(0), x)
    labels = muon_optax.label_by_path([("Dense_2", "head")])
    assert flat_labels_by_path(labels, params) == {
        "params/Dense_0/bias": "adamw", "params/Dense_0/kernel": "muon",
        "params/Dense_1/bias": "adamw", "params/Dense_1/kernel": "muon",
        "params/Dense_2/bias": "head", "params/Dense_2/kernel": "head",
        "params/scale": "adamw"}
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=muon_optax.muon_adamw(NNX_GROUPS, labels))

    @jax.jit
    def train_step(state):
        loss_fn = lambda p: jnp.mean((state.apply_fn(p, x) - y) ** 2)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(30):
        state, loss = train_step(state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    assert int(state.step) == 30 and int(state.opt_state.count) == 30


# ----------------------------------------------------------------------------- jit, checkpoints

def test_donated_params_and_state_match_undonated_bitwise():
    donated = jax.jit(step_fn(TX), donate_argnums=(0, 1))
    p_plain = random_tree(SHAPES)
    s_plain = TX.init(p_plain)
    p_don, s_don = jax.tree.map(jnp.copy, (p_plain, s_plain))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            p_plain, s_plain = STEP(p_plain, s_plain, grads_at(step))
            old = (p_don, s_don)
            p_don, s_don = donated(p_don, s_don, grads_at(step))
            # The donated inputs were consumed (their buffers reused for the outputs).
            assert all(x.is_deleted() for x in jax.tree.leaves(old))
    donation = [str(w.message) for w in caught if "donat" in str(w.message).lower()]
    assert not donation, donation
    chex.assert_trees_all_equal((p_don, s_don), (p_plain, s_plain))


def test_orbax_checkpoint_restore_resumes_bitwise(tmp_path):
    params, state = run(3)

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    ckptr.wait_until_finished()
    abstract = jax.eval_shape(lambda p: {"params": p, "opt_state": TX.init(p)}, params)
    restored = ckptr.restore(tmp_path / "ckpt", abstract)
    # The state keeps its type and its MaskedNode entries (empty NamedTuples).
    assert isinstance(restored["opt_state"], muon_optax.MuonAdamWState)
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state)
    assert isinstance(restored["opt_state"].mu["w1"], optax.MaskedNode)
    chex.assert_trees_all_equal(restored, {"params": params, "opt_state": state})

    r_params, r_state = restored["params"], restored["opt_state"]
    for i in range(3, 6):
        params, state = STEP(params, state, grads_at(i))
        r_params, r_state = STEP(r_params, r_state, grads_at(i))
    chex.assert_trees_all_equal((r_params, r_state), (params, state))


# ----------------------------------------------------------------------------- optax parity

@pytest.mark.parametrize("schedule", [False, True])
def test_adamw_matches_optax_adamw(schedule):
    lr = optax.cosine_decay_schedule(0.01, 10, alpha=0.1) if schedule else 0.01
    b1, b2, eps, wd = 0.8, 0.95, 1e-8, 0.1
    shapes = {"w": (16, 32), "v": (40,), "s": ()}
    params0 = random_tree(shapes)
    grads = lambda step: random_tree(shapes, seed=100 + step)  # noqa: E731
    txs = {
        "optax": optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd),
        "adamw": muon_optax.adamw(lr, betas=(b1, b2), eps=eps, weight_decay=wd),
        "muon_adamw": muon_optax.muon_adamw(
            {"a": dict(kind="adamw", lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)},
            lambda p: jax.tree.map(lambda _: "a", p)),
    }
    out = {}
    for name, tx in txs.items():
        params, state = params0, tx.init(params0)
        update = jax.jit(tx.update)
        for step in range(10):
            updates, state = update(grads(step), state, params)
            params = optax.apply_updates(params, updates)
        out[name] = params
    assert_trees_differ(out["optax"], params0)
    chex.assert_trees_all_close(out["adamw"], out["optax"], rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(out["muon_adamw"], out["optax"], rtol=1e-6, atol=1e-7)


def test_muon_inside_optax_partition_equals_muon_adamw_branch():
    kw = {k: v for k, v in muon_group().items() if k != "kind"}
    part = optax.partition({"m": muon_optax.muon(**kw), "a": optax.adam(1e-3)}, LABELS)
    params = random_tree(SHAPES)
    p_state, f_state = part.init(params), TX.init(params)
    p_update = jax.jit(part.update)
    for step in range(4):
        p_upd, p_state = p_update(grads_at(step), p_state, params)
        f_upd, f_state = UPDATE(grads_at(step), f_state, params)
        for name in ("w1", "w2", "w3"):
            np.testing.assert_array_equal(p_upd[name], f_upd[name], err_msg=name)
        params = optax.apply_updates(params, f_upd)
    chex.assert_trees_all_equal(p_state.inner_states["m"].inner_state.muon, f_state.muon)
