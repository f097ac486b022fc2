"""Bad configurations fail early, with a message that names the culprit and the fix."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import muon_optax
from muon_optax import MuonDimensionNumbers

try:
    from .test_optimizer import adamw_group, muon_group
except ImportError:  # plain `pytest` rootdir imports
    from test_optimizer import adamw_group, muon_group

GROUPS = {"m": muon_group(), "a": adamw_group()}


def zeros(shapes):
    return {k: jnp.zeros(s) for k, s in shapes.items()}


def build(groups=None, labels=None, **kw):
    groups = GROUPS if groups is None else groups
    labels = muon_optax.label_by_path(matrix="m", other="a") if labels is None else labels
    return muon_optax.muon_adamw(groups, labels, **kw)


# ----------------------------------------------------------------------------- leaves and labels

@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", [(), (7,)])
def test_muon_group_given_scalar_or_vector_names_the_path(shape, jit):
    params = {"blocks": {"0": {"norm": {"scale": jnp.ones(shape)}, "w": jnp.ones((4, 8))}}}
    tx = build(labels=lambda p: jax.tree.map(lambda _: "m", p))
    init = jax.jit(tx.init) if jit else tx.init
    with pytest.raises(ValueError, match=r"'blocks/0/norm/scale' has shape .*Muon group 'm'"
                                         r".*AdamW group"):
        init(params)


@pytest.mark.parametrize("jit", [False, True])
def test_label_naming_no_group(jit):
    params = zeros({"w": (4, 8), "b": (8,)})
    tx = build(labels={"w": "m", "b": "adam"})
    init = jax.jit(tx.init) if jit else tx.init
    with pytest.raises(ValueError, match=r"'b' has label 'adam', which names no group; "
                                         r"groups are 'm', 'a'"):
        init(params)


def test_labels_with_wrong_structure():
    params = zeros({"w": (4, 8), "b": (8,)})
    with pytest.raises(ValueError, match="param_labels must have the params' structure"):
        build(labels={"w": "m"}).init(params)


# ----------------------------------------------------------------------------- group dicts

def test_unknown_kind():
    with pytest.raises(ValueError, match=r"group 'm': unknown kind 'sgd'; use kind='adamw' "
                                         r"or kind='muon'"):
        build({"m": muon_group(kind="sgd")})


def test_missing_kind():
    group = {k: v for k, v in muon_group().items() if k != "kind"}
    with pytest.raises(ValueError, match="group 'm': unknown kind None"):
        build({"m": group})


@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_missing_lr(kind):
    group = {k: v for k, v in (muon_group() if kind == "muon" else adamw_group()).items()
             if k != "lr"}
    article = "an" if kind == "adamw" else "a"
    with pytest.raises(ValueError, match=rf"group 'g': missing hyperparameter lr for "
                                         rf"kind='{kind}'; {article} {kind} group needs lr"):
        build({"g": group}, labels=lambda p: jax.tree.map(lambda _: "g", p))


def test_groups_take_the_constructors_defaults():
    """A group names only what differs from muon_optax.adamw's and muon's defaults."""
    tx = muon_optax.muon_adamw({"a": dict(kind="adamw", lr=1e-3),
                                "m": dict(kind="muon", lr=0.02, ns_steps=4)},
                               lambda p: jax.tree.map(lambda _: "m", p))
    assert tx.init.configs["a"] == muon_optax.adamw(1e-3).init.configs["adamw"]
    assert tx.init.configs["m"] == muon_optax.muon(0.02, ns_steps=4).init.configs["muon"]


def test_unknown_hyperparameter_lists_allowed_keys():
    with pytest.raises(ValueError, match=r"group 'a': unknown hyperparameter 'wd' .*"
                                         r"allowed keys are .*weight_decay"):
        build({"m": muon_group(), "a": adamw_group(wd=0.1)})


def test_misspelled_hyperparameter_gets_a_suggestion():
    with pytest.raises(ValueError, match=r"'momentun' \(did you mean 'momentum'\?\)"):
        build({"m": muon_group(momentun=0.9), "a": adamw_group()})


def test_adamw_key_in_muon_group():
    with pytest.raises(ValueError, match=r"unknown hyperparameter 'betas'.*kind='muon'"):
        build({"m": muon_group(betas=(0.9, 0.95)), "a": adamw_group()})


def test_group_holding_params():
    with pytest.raises(ValueError, match=r"group 'm': a group holds no 'params' here; .*"
                                         r"param_labels"):
        build({"m": muon_group(params=[jnp.ones((4, 4))]), "a": adamw_group()})


@pytest.mark.parametrize("ns_steps,exc,msg", [
    (0, ValueError, r"ns_steps=0 is outside 1\.\.5"),
    (6, ValueError, r"ns_steps=6 is outside 1\.\.5"),
    (2.5, TypeError, r"ns_steps must be a Python int in 1\.\.5, got 2\.5"),
    (True, TypeError, r"ns_steps must be a Python int"),
])
def test_bad_ns_steps(ns_steps, exc, msg):
    with pytest.raises(exc, match=rf"group 'm': {msg}"):
        build({"m": muon_group(ns_steps=ns_steps), "a": adamw_group()})
    with pytest.raises(exc, match=rf"muon: {msg}"):
        muon_optax.muon(0.02, ns_steps=ns_steps)
    with pytest.raises(exc, match=msg):
        muon_optax.orthogonalize(jnp.ones((4, 4)), ns_steps)


@pytest.mark.parametrize("ns_steps", [np.int64(3), np.int32(3), np.array(3)])
def test_numpy_integer_ns_steps(ns_steps):
    tx = muon_optax.muon(0.02, ns_steps=ns_steps)
    assert type(tx.init.configs["muon"].ns_steps) is int
    build({"m": muon_group(ns_steps=ns_steps), "a": adamw_group()})
    assert muon_optax.orthogonalize(jnp.eye(4), ns_steps).shape == (4, 4)


@pytest.mark.parametrize("ns_steps", [np.bool_(True), np.float64(3.0), jnp.array(3)])
def test_bad_numpy_or_jax_ns_steps(ns_steps):
    with pytest.raises(TypeError, match=r"muon: ns_steps must be a Python int in 1\.\.5"):
        muon_optax.muon(0.02, ns_steps=ns_steps)
@pytest.mark.parametrize("option,exc,msg", [
    (dict(ns_coeffs="polarexpress"), ValueError,
     r"unknown ns_coeffs preset 'polarexpress' \(did you mean 'polar_express'\?\); presets "
     r"are 'polar_express', 'quintic'"),
    (dict(ns_coeffs=(1.0, 2.0)), ValueError, r"ns_coeffs must be a triple .*got shape \(2,\)"),
    (dict(ns_coeffs=((1, 2, 3),) * 3), ValueError,
     r"ns_coeffs has 3 rows, too few for ns_steps=5 \(one row per iteration\); pass "
     r"ns_steps <= 3 or a longer table"),
    (dict(ns_coeffs="quintic", ns_steps=0), ValueError, r"ns_steps=0; Muon needs at least"),
    (dict(preconditioning="frobenious"), ValueError,
     r"unknown preconditioning 'frobenious' \(did you mean 'frobenius'\?\); use one of "
     r"'basin', 'frobenius', 'spectral', 'aol', 'schatten'"),
    (dict(nesterov="yes"), TypeError, r"nesterov must be True or False, got 'yes'"),
    (dict(normuon=1), TypeError, r"normuon must be True or False"),
    (dict(cautious=None), TypeError, r"cautious must be True or False"),
    (dict(mu_dtype=jnp.int32), TypeError, r"mu_dtype must be a float dtype, got int32"),
    (dict(mu_dtype="half-float"), TypeError, r"mu_dtype 'half-float' is not a dtype"),
])
def test_bad_muon_option(option, exc, msg):
    with pytest.raises(exc, match=rf"group 'm': {msg}"):
        build({"m": muon_group(**option), "a": adamw_group()})
    with pytest.raises(exc, match=rf"muon: {msg}"):
        muon_optax.muon(0.02, **option)


@pytest.mark.parametrize("value", ["abc", [0.1], jnp.array([0.1, 0.2])])
def test_bad_scalar(value):
    with pytest.raises(TypeError, match=r"group 'a': lr must be a float or an optax schedule"):
        build({"m": muon_group(), "a": adamw_group(lr=value)})


@pytest.mark.parametrize("value", ["1e-3", "float32", None])
def test_bad_scalar_string_or_none(value):
    with pytest.raises(TypeError, match=r"group 'a': lr must be a float or an optax schedule"):
        build({"m": muon_group(), "a": adamw_group(lr=value)})


def test_bad_betas():
    with pytest.raises(TypeError, match=r"group 'a': betas must be a pair \(b1, b2\)"):
        build({"m": muon_group(), "a": adamw_group(betas=0.9)})


def test_empty_groups():
    with pytest.raises(TypeError, match="groups must be a non-empty dict"):
        build({})


# ----------------------------------------------------------------------------- update

PARAMS = zeros({"w": (4, 8), "b": (8,)})


@pytest.mark.parametrize("jit", [False, True])
def test_update_without_params(jit):
    tx = build()
    state = tx.init(PARAMS)
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match=r"update needs the params .*"
                                         r"tx\.update\(grads, state, params\)"):
        update(PARAMS, state)


@pytest.mark.parametrize("make,name", [
    (lambda: muon_optax.muon(0.02), "muon"),
    (lambda: muon_optax.adamw(0.01, weight_decay=0.1), "adamw"),
    (lambda: muon_optax.muon_adamw(GROUPS, muon_optax.label_by_path(matrix="m", other="a")),
     "muon_adamw"),
])
def test_update_errors_name_the_constructor(make, name):
    tx = make()
    params = {"w": jnp.zeros((4, 8))}
    state = tx.init(params)
    with pytest.raises(ValueError, match=rf"^{name}: update needs the params"):
        tx.update(params, state)
    with pytest.raises(ValueError, match=rf"^{name}: the gradient of 'w' has shape"):
        tx.update({"w": jnp.zeros((8, 4))}, state, params)


def test_update_without_params_is_fine_without_weight_decay():
    tx = muon_optax.adamw(0.01)
    updates, _ = tx.update(PARAMS, tx.init(PARAMS))
    assert jax.tree.structure(updates) == jax.tree.structure(PARAMS)


@pytest.mark.parametrize("jit", [False, True])
def test_grads_with_other_structure(jit):
    tx = build()
    state = tx.init(PARAMS)
    update = jax.jit(tx.update) if jit else tx.update
    grads = {"w": PARAMS["w"], "c": PARAMS["b"]}
    with pytest.raises(ValueError, match=r"grads and params differ in structure"):
        update(grads, state, PARAMS)


@pytest.mark.parametrize("jit", [False, True])
def test_grad_with_other_shape_names_the_path(jit):
    tx = build()
    state = tx.init(PARAMS)
    update = jax.jit(tx.update) if jit else tx.update
    grads = {"w": jnp.zeros((8, 4)), "b": PARAMS["b"]}
    with pytest.raises(ValueError, match=r"gradient of 'w' has shape \(8, 4\) but the "
                                         r"parameter has shape \(4, 8\)"):
        update(grads, state, PARAMS)


def test_state_for_other_params():
    tx = build()
    state = tx.init(PARAMS)
    other = {"w": jnp.zeros((4, 8)), "b": jnp.zeros((8, 8))}  # b becomes a second stack
    with pytest.raises(ValueError, match=r"state was made for other params.*call tx\.init"):
        tx.update(other, state, other)


@pytest.mark.parametrize("jit", [False, True])
def test_state_for_bigger_params_names_the_first_mismatching_leaf(jit):
    # Same structure and stacks, more matrices and longer vectors: once the one momentum
    # was broadcast to all three matrices; now the shapes are compared leaf by leaf.
    groups = {"m": dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95,
                        weight_decay=0.0),
              "a": dict(kind="adamw", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)}
    tx = muon_optax.muon_adamw(groups, muon_optax.label_by_path(matrix="m", other="a"))
    small = {"k": jnp.zeros((1, 16, 32)), "v": jnp.zeros((64,))}
    big = {"k": jnp.ones((3, 16, 32)), "v": jnp.ones((128,))}
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match=r"state leaf .mu\['v'\] has shape \(64,\).*\(128,\)"):
        update(big, tx.init(small), big)
    only_k = {"k": jnp.ones((3, 16, 32)), "v": jnp.ones((64,))}   # the Muon buffers differ
    with pytest.raises(ValueError, match=r"state leaf .muon\[0\].momentum.*tx.init"):
        update(only_k, tx.init(small), only_k)


def test_state_of_another_optimizer_is_a_clear_error():
    tx, other = build(), muon_optax.adamw(1e-3)
    with pytest.raises(ValueError, match=r"state was made for other params or another optimizer"):
        tx.update(PARAMS, other.init(PARAMS), PARAMS)


# ----------------------------------------------------------------------------- layouts, sharding

@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dims", [MuonDimensionNumbers(reduction_axis=0, output_axis=2),
                                  MuonDimensionNumbers(reduction_axis=-3, output_axis=1)])
def test_dimension_numbers_out_of_range_names_the_path(dims, jit):
    tx = build(dimension_numbers={"w": dims, "b": None})
    init = jax.jit(tx.init) if jit else tx.init
    with pytest.raises(ValueError, match=r"parameter 'w' has 2 axes; .*out of range\. "
                                         r"Fix its MuonDimensionNumbers"):
        init(PARAMS)


def test_dimension_numbers_overlapping_axes():
    dims = MuonDimensionNumbers(reduction_axis=0, output_axis=0)
    with pytest.raises(ValueError, match=r"parameter 'w': reduction_axis .* must be distinct"):
        build(dimension_numbers=dims).init(PARAMS)


def test_dimension_numbers_with_wrong_structure():
    with pytest.raises(ValueError, match="dimension_numbers must be one MuonDimensionNumbers"):
        build(dimension_numbers={"w": None}).init(PARAMS)


def test_state_specs_without_axis_name():
    mesh = Mesh(jax.devices()[:1], ("data",))
    with pytest.raises(ValueError, match=r"built without axis_name; pass axis_name='data'"):
        muon_optax.state_specs(build(), PARAMS, mesh)


def test_state_specs_with_other_axis_name():
    mesh = Mesh(jax.devices()[:1], ("data",))
    with pytest.raises(ValueError, match=r"mesh has axes \('data',\), not 'model'"):
        muon_optax.state_specs(build(axis_name="model"), PARAMS, mesh)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_mesh_optimizer_inside_a_users_shard_map():
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    tx = build(axis_name="data", mesh=mesh)
    with pytest.raises(ValueError, match="inside your own shard_map build it without mesh="):
        jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()))(PARAMS)


def test_orthogonalize_needs_a_matrix():
    with pytest.raises(ValueError, match=r"needs \(\.\.\., R, C\) matrices, got shape \(5,\)"):
        muon_optax.orthogonalize(jnp.ones(5))


def test_label_by_path_bad_rules():
    with pytest.raises(TypeError, match=r"each rule is a \(regex, group\) pair"):
        muon_optax.label_by_path(["wte"])
    with pytest.raises(ValueError, match=r"bad regex '\('"):
        muon_optax.label_by_path([("(", "embed")])


def test_non_array_leaf_names_the_path():
    with pytest.raises(TypeError, match=r"parameter 'n' is a str, not an array"):
        build().init({"w": jnp.zeros((4, 8)), "n": "hello"})


# ---------------------------------------------------------------------- dtypes and magnitudes

@pytest.mark.parametrize("dtype, words", [
    (jnp.complex64, "'blocks/w' is complex (complex64); the rule is defined for real params"),
    (jnp.int32, "'blocks/w' is int32, not a floating dtype"),
])
@pytest.mark.parametrize("jit", [False, True])
def test_complex_and_integer_params_are_refused_at_init(dtype, words, jit):
    params = {"blocks": {"w": jnp.ones((4, 8), dtype)}, "b": jnp.ones((8,))}
    tx = build()
    init = jax.jit(tx.init) if jit else tx.init
    with pytest.raises(TypeError, match=re.escape(words)):
        init(params)
    adamw_only = build(labels=lambda p: jax.tree.map(lambda _: "a", p))
    with pytest.raises(TypeError, match="'blocks/w' is"):
        adamw_only.init(params)


def test_a_param_that_changes_dtype_after_init_is_refused():
    params = {"blocks": {"w": jnp.ones((4, 8))}, "b": jnp.ones((8,))}
    tx = build()
    state = tx.init(params)
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.raises(TypeError, match=r"is float32, but these params need bfloat16: a "
                                        r"parameter changed dtype after tx.init \(now bfloat16"):
        tx.update(half, state, half)


def test_huge_finite_muon_gradients_give_finite_updates():
    """The normalization's Frobenius norm of 1e20 entries overflows float32 when squared;
    nanochat's rule is scale-invariant there, so the update is that of the gradient / 1e20
    (up to its 1e-6 guards)."""
    params = {"blocks": {"w": jnp.ones((8, 16))}, "b": jnp.ones((16,))}
    tx = build()
    state = tx.init(params)
    g = jax.random.normal(jax.random.key(0), (8, 16))
    small, _ = tx.update({"blocks": {"w": g}, "b": jnp.ones(16)}, state, params)
    for scale in (1e20, 3e36):
        big, _ = jax.jit(tx.update)({"blocks": {"w": g * scale}, "b": jnp.ones(16)}, state,
                                    params)
        assert bool(jnp.all(jnp.isfinite(big["blocks"]["w"])))
        np.testing.assert_allclose(big["blocks"]["w"], small["blocks"]["w"], atol=1e-4)
    w = jnp.full((3, 5), 2e19)
    np.testing.assert_allclose(muon_optax.rule.polar.fro_norm(w)[0, 0], 2e19 * np.sqrt(15),
                               rtol=1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, "1", True])
def test_bad_max_grad_norm(bad):
    with pytest.raises(ValueError, match="adamw: max_grad_norm must be a positive number"):
        muon_optax.adamw(1e-3, max_grad_norm=bad)


def test_bad_skip_nonfinite():
    with pytest.raises(TypeError, match="muon: skip_nonfinite must be True or False"):
        muon_optax.muon(0.02, skip_nonfinite=1)
