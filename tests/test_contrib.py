"""contrib_muon against optax.contrib.muon itself: the same updates, and clearer errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers as MDN

import muon_optax
from muon_optax.api.contrib import contrib_coefficients
from muon_optax.rule.coefficients import DION_COEFFS, POLAR_EXPRESS_COEFFS, QUINTIC_COEFFS
from muon_optax.rule.contrib import OptaxAdamConfig

SHAPES = {"blocks": {"fc": (16, 48), "proj": (48, 16), "attn": {"q": (32, 32), "k": (32, 32)},
                     "scale": (16,)},
          "embed": (40, 16), "bias": (16,), "gain": (), "stack": (3, 16, 24)}
TOL = 1e-5


def random_tree(seed):
    leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return treedef.unflatten([0.5 * jax.random.normal(k, s) for k, s in zip(keys, leaves)])


def param_changes(tx, steps=10):
    params = p0 = random_tree(0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(steps):
        updates, state = update(random_tree(100 + step), state, params)
        params = optax.apply_updates(params, updates)
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                        params, p0)


def assert_same_updates(**kw):
    want = param_changes(optax.contrib.muon(**kw))
    got = param_changes(muon_optax.contrib_muon(**kw))
    paths = jax.tree_util.tree_flatten_with_path(want)[0]
    for (path, w), g in zip(paths, jax.tree.leaves(got)):
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel <= TOL, f"{jax.tree_util.keystr(path)}: relative error {rel:.2e}"


def no_decay_on_squares(params):
    return jax.tree.map(lambda x: not (x.ndim == 2 and x.shape[0] == x.shape[1]), params)


CASES = {
    "defaults": dict(learning_rate=0.02),
    "polar_express_table_decay_mask_schedule": dict(
        learning_rate=optax.linear_schedule(0.02, 0.005, 10), ns_coeffs=POLAR_EXPRESS_COEFFS,
        weight_decay=0.1, weight_decay_mask=no_decay_on_squares),
    "no_nesterov_aol_bf16_momentum": dict(
        learning_rate=0.02, nesterov=False, preconditioning="aol", mu_dtype=jnp.bfloat16),
    "schatten_adaptive_consistent_rms": dict(
        learning_rate=0.02, preconditioning="schatten", adaptive=True, consistent_rms=0.2),
    "spectral_dion_preset": dict(learning_rate=0.02, preconditioning="spectral",
                                 ns_coeffs="dion"),
    "short_table_runs_its_rows": dict(learning_rate=0.02, ns_coeffs=DION_COEFFS[:3]),
    "adam_options_decay_schedule": dict(
        learning_rate=0.02, adam_b1=0.8, adam_b2=0.95, adam_eps_root=1e-6,
        adam_weight_decay=0.1, adam_learning_rate=optax.cosine_decay_schedule(0.003, 10),
        weight_decay=optax.linear_schedule(0.1, 0.0, 10), ns_steps=4),
    # Prefix trees; a 3-D leaf of 3 matrices; squares in both layouts (AOL tells them apart).
    "dimension_numbers_batch_axes_aol_adaptive": dict(
        learning_rate=0.02, preconditioning="aol", adaptive=True, eps=1e-7,
        muon_weight_dimension_numbers={
            "blocks": {"fc": MDN(), "proj": MDN(1, 0), "attn": {"q": MDN(1, 0), "k": MDN()},
                       "scale": None},
            "embed": None, "bias": None, "gain": None, "stack": MDN(1, 2)},
        weight_decay=0.05, weight_decay_mask={"blocks": True, "embed": False, "bias": False,
                                              "gain": False, "stack": False}),
    "callable_dimension_numbers": dict(
        learning_rate=0.02, preconditioning="aol", weight_decay=0.1,
        muon_weight_dimension_numbers=lambda p: {
            "blocks": {"fc": MDN(), "proj": MDN(), "attn": MDN(), "scale": None},
            "embed": None, "bias": None, "gain": None, "stack": MDN(2, 1)}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_updates_as_optax(name):
    assert_same_updates(**CASES[name])


def test_masked_and_decayed_matrices_share_a_stack():
    def no_decay_on_k(params):
        return jax.tree_util.tree_map_with_path(lambda p, x: "'k'" not in str(p), params)

    tx = muon_optax.contrib_muon(0.02, weight_decay=0.1, weight_decay_mask=no_decay_on_k)
    info = tx.init.stack_info(random_tree(0))
    squares = [s for s in info if s["shape"] == (32, 32)]
    assert len(squares) == 1 and squares[0]["size"] == 2
    assert sorted(squares[0]["members"]) == ["blocks/attn/k", "blocks/attn/q"]
    # Stored as laid out: the (in, out) kernels fc (16, 48) and proj (48, 16) apart.
    assert [s["members"] for s in info if s["shape"] == (16, 48)] == [["blocks/fc"]]
    assert [s["members"] for s in info if s["shape"] == (48, 16)] == [["blocks/proj"]]
    assert sum(s["size"] for s in info) == 5          # 2-D leaves only, by default


def test_coefficients_as_optax_reads_them():
    assert contrib_coefficients("standard", 3) == QUINTIC_COEFFS * 3
    assert contrib_coefficients("dion", 5) == DION_COEFFS
    assert contrib_coefficients("dion", 8) == DION_COEFFS           # a table runs its rows
    assert contrib_coefficients(np.ones((2, 3)), 5) == ((1.0,) * 3,) * 2


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(ns_coeffs="muon"), ValueError,
     r"contrib_muon: unknown ns_coeffs preset 'muon'; presets are 'standard', 'dion', "
     r"'quintic', 'polar_express'"),
    (dict(ns_coeffs="dio"), ValueError, r"\(did you mean 'dion'\?\)"),
    (dict(ns_coeffs=(1.0, 2.0)), ValueError,
     r"contrib_muon: ns_coeffs must be a triple \(a, b, c\) \(shape \(3,\)\) or an \(n, 3\) "
     r"table, one row per iteration; got shape \(2,\)"),
    (dict(ns_coeffs=np.ones((2, 2, 3))), ValueError, r"got shape \(2, 2, 3\)"),
    (dict(ns_coeffs=(1.0, "a", 2.0)), ValueError, r"ns_coeffs must be a preset name"),
    (dict(ns_coeffs="dion", ns_steps=3), ValueError,
     r"contrib_muon: ns_coeffs is a table of 5 rows, one per iteration, but ns_steps=3: too "
     r"few steps for its coefficients .* Pass ns_steps >= 5, or keep the last 3 rows"),
    (dict(ns_steps=0), ValueError, r"contrib_muon: ns_steps=0; Muon needs at least one"),
    (dict(ns_steps=2.0), TypeError, r"contrib_muon: ns_steps must be an int, got 2\.0"),
    (dict(preconditioning="basin"), ValueError,
     r"contrib_muon: unknown preconditioning 'basin'; use one of 'frobenius', 'spectral', "
     r"'aol', 'schatten'"),
    (dict(preconditioning="Schatten"), ValueError, r"\(did you mean 'schatten'\?\)"),
    (dict(mu_dtype="int8"), TypeError, r"contrib_muon: mu_dtype must be a float dtype"),
    (dict(consistent_rms="0.2x"), TypeError, r"consistent_rms must be a number"),
])
def test_bad_arguments_fail_at_construction(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        muon_optax.contrib_muon(0.02, **kw)


def test_bad_trees_name_the_argument():
    params = random_tree(0)
    tx = muon_optax.contrib_muon(0.02, muon_weight_dimension_numbers={"embed": MDN()})
    with pytest.raises(ValueError, match=r"muon_weight_dimension_numbers must be a tree with "
                                         r"the params' structure, or a prefix of it"):
        tx.init(params)
    tx = muon_optax.contrib_muon(0.02, weight_decay=0.1, weight_decay_mask={"x": True})
    with pytest.raises(ValueError, match=r"weight_decay_mask must be a tree of Python bools"):
        tx.init(params)


def test_a_vector_given_to_muon_is_named():
    tx = muon_optax.contrib_muon(0.02, muon_weight_dimension_numbers=MDN())
    with pytest.raises(ValueError, match=r"'bias' has shape \(16,\) .*Muon"):
        tx.init(random_tree(0))


def test_complex_parameters_are_refused():
    params = {"w": jnp.ones((4, 8), jnp.complex64)}
    with pytest.raises(TypeError, match=r"'w' is complex \(complex64\)"):
        muon_optax.contrib_muon(0.02).init(params)


def test_update_needs_params():
    tx = muon_optax.contrib_muon(0.02)
    params = random_tree(0)
    with pytest.raises(ValueError, match="update needs the params"):
        tx.update(params, tx.init(params))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize("mode", ["fsdp", "zero2"])
def test_sharded_contrib_muon_matches_optax(mode):
    """The same updates with the params FSDP-split under plain jit (mesh=), or whole on
    every device inside shard_map (ZeRO-2, every device the same gradient); the 3-D leaf's
    matrices sit on different devices, so adaptive's per-leaf sum crosses devices."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    kw = CASES["dimension_numbers_batch_axes_aol_adaptive"]
    want = param_changes(optax.contrib.muon(**kw))
    n = 8
    params = p0 = random_tree(0)
    if mode == "fsdp":
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
        tx = muon_optax.contrib_muon(**kw, axis_name="data", mesh=mesh)
        spec = lambda x: P("data") if x.ndim >= 2 and x.shape[0] % n == 0 else P()  # noqa: E731
        put = lambda t: jax.tree.map(  # noqa: E731
            lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), t)
        state, step = jax.jit(tx.init)(put(params)), jax.jit(tx.update)
        params = put(params)
    else:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
        tx = muon_optax.contrib_muon(**kw, axis_name="data")
        specs = muon_optax.state_specs(tx, params, mesh)
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(
            params)
        step = jax.jit(jax.shard_map(
            lambda g, s, p: tx.update(jax.tree.map(lambda x: x[0], g), s, p), mesh=mesh,
            in_specs=(P("data"), specs, P()), out_specs=(P(), specs)))
        put = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), t)  # noqa
    for s in range(10):
        grads = random_tree(100 + s)
        updates, state = step(put(grads), state, params)
        params = optax.apply_updates(params, updates)
    for (path, w), g, a in zip(jax.tree_util.tree_flatten_with_path(want)[0],
                               jax.tree.leaves(params), jax.tree.leaves(p0)):
        change = np.asarray(g, np.float64) - np.asarray(a, np.float64)
        rel = np.linalg.norm(change - w) / np.linalg.norm(w)
        assert rel <= TOL, f"{jax.tree_util.keystr(path)}: relative error {rel:.2e}"


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("eps_root", [0.0, 1e-6])
@pytest.mark.parametrize("mu_dtype", [None, jnp.bfloat16])
def test_adam_leaf_update_matches_optax_adamw(nesterov, eps_root, mu_dtype):
    lr = optax.linear_schedule(0.01, 0.002, 10)
    kw = dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=eps_root, weight_decay=0.1,
              mu_dtype=mu_dtype, nesterov=nesterov)
    tx = optax.adamw(lr, **kw)
    cfg = OptaxAdamConfig.make(lr, (0.9, 0.999), 1e-8, 0.1, eps_root=eps_root,
                               nesterov=nesterov, mu_dtype=mu_dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), 11)
    p = jax.random.normal(keys[0], (6, 5))
    state = tx.init(p)
    m = jnp.zeros_like(p, dtype=mu_dtype or p.dtype)
    v = jnp.zeros_like(p)
    for step in range(10):
        g = jax.random.normal(keys[step + 1], p.shape)
        want, state = tx.update(g, state, p)
        hp = cfg.at(jnp.int32(step))
        got, m, v = cfg.step(g, p, m, v, jnp.int32(step + 1), hp)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)
        np.testing.assert_array_equal(m, state[0].mu)
        np.testing.assert_allclose(v, state[0].nu, rtol=1e-6)
        p = p + got


def test_eps_root_is_left_out_when_zero():
    assert "eps_root" not in OptaxAdamConfig.make(0.1, (0.9, 0.99), 1e-8, 0.0).at(0)
    assert "eps_root" in OptaxAdamConfig.make(0.1, (0.9, 0.99), 1e-8, 0.0, eps_root=1e-9).at(0)
