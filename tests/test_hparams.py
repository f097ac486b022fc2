"""Hyperparameters: injected by optax.inject_hyperparams, and read back for logging."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax

try:
    from .test_optimizer import adamw_group, muon_group, random_tree
except ImportError:  # plain `pytest` rootdir imports
    from test_optimizer import adamw_group, muon_group, random_tree

SHAPES = {"w": (3, 8, 16), "b": (16,)}


def run(tx, params, steps=3, jit=True, hyperparams=None):
    """``steps`` updates on fixed random gradients; returns the params and the state."""
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    for step in range(steps):
        if hyperparams is not None:
            state.hyperparams.update(hyperparams(step))
        updates, state = update(random_tree(SHAPES, 10 + step), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("weight_decay", [None, 0.1])
def test_inject_hyperparams_adamw_under_jit(weight_decay):
    params = random_tree(SHAPES)
    kw = {} if weight_decay is None else {"weight_decay": weight_decay}
    # The injected weight decay arrives traced: it used to be compared with 0.0 in Python.
    injected = optax.inject_hyperparams(muon_optax.adamw)(lr=1e-2, **kw)
    got, state = run(injected, params)
    want, _ = run(muon_optax.adamw(1e-2, **kw), params)
    for k in params:
        np.testing.assert_array_equal(got[k], want[k])
    assert float(state.hyperparams["lr"]) == pytest.approx(1e-2)


def test_inject_hyperparams_adamw_lr_changed_in_the_state():
    params = random_tree(SHAPES)
    lrs = [1e-2, 3e-3, 1e-3]
    injected = optax.inject_hyperparams(muon_optax.adamw)(lr=1.0, weight_decay=0.1)
    got, _ = run(injected, params, hyperparams=lambda step: {"lr": jnp.float32(lrs[step])})
    want, _ = run(muon_optax.adamw(lambda count: jnp.asarray(lrs)[count], weight_decay=0.1),
                  params)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-7)


@pytest.mark.parametrize("static,dtype", [(("ns_steps",), "float32"),
                                          (("ns_steps", "compute_dtype"), jnp.float32)])
def test_inject_hyperparams_muon_with_static_ns_steps_under_jit(static, dtype):
    params = {"w": random_tree(SHAPES)["w"]}
    make = optax.inject_hyperparams(muon_optax.muon, static_args=static)
    injected = make(lr=0.02, momentum=0.9, ns_steps=3, weight_decay=0.1, compute_dtype=dtype)
    state = injected.init(params)
    update = jax.jit(injected.update)
    plain = muon_optax.muon(0.02, 0.9, 3, weight_decay=0.1, compute_dtype=jnp.float32)
    plain_state = plain.init(params)
    grads = {"w": random_tree(SHAPES, 5)["w"]}
    for _ in range(2):
        got, state = update(grads, state, params)
        want, plain_state = plain.update(grads, plain_state, params)
        np.testing.assert_allclose(got["w"], want["w"], rtol=0, atol=1e-7)
    assert set(state.hyperparams) == {"lr", "momentum", "beta2", "weight_decay"}


def test_inject_hyperparams_muon_without_static_ns_steps_says_how():
    params = {"w": jnp.ones((8, 16))}
    injected = optax.inject_hyperparams(muon_optax.muon)(lr=0.02)
    with pytest.raises(TypeError, match=r"muon: ns_steps must be a Python int .*JAX array.*"
                                        r"static_args=\(\"ns_steps\",\)"):
        jax.jit(injected.init)(params)


def test_inject_hyperparams_muon_with_callable_dtype_says_how():
    # jnp.float32 is callable, so inject_hyperparams takes it for a schedule.
    make = optax.inject_hyperparams(muon_optax.muon, static_args=("ns_steps",))
    injected = make(lr=0.02, compute_dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"compute_dtype must be a dtype, got an array.*"
                                        r"static_args=\(\"ns_steps\", \"compute_dtype\"\)"):
        injected.init({"w": jnp.ones((8, 16))})


# ----------------------------------------------------------------------------- logging

def groups():
    return {"m": muon_group(weight_decay=optax.linear_schedule(0.2, 0.0, 10)),
            "a": adamw_group()}


def expected(count):
    m, a = groups()["m"], adamw_group()
    return {"m": {"lr": m["lr"](count), "momentum": m["momentum"](count),
                  "beta2": m["beta2"](count), "weight_decay": m["weight_decay"](count)},
            "a": {"lr": a["lr"](count), "b1": 0.8, "b2": 0.95, "eps": 1e-10,
                  "weight_decay": a["weight_decay"](count)}}


def assert_hparams_close(got, want):
    assert {g: set(v) for g, v in got.items()} == {g: set(v) for g, v in want.items()}
    for g in want:
        for k in want[g]:
            assert got[g][k].dtype == jnp.float32, (g, k)
            np.testing.assert_allclose(got[g][k], want[g][k], rtol=1e-6, err_msg=f"{g}/{k}")


@pytest.mark.parametrize("jit", [False, True])
def test_current_hyperparams_follow_the_schedules(jit):
    tx = muon_optax.muon_adamw(groups(), muon_optax.label_by_path(matrix="m", other="a"))
    params = random_tree(SHAPES)
    _, state = run(tx, params, steps=4)
    assert int(state.count) == 4
    read = jax.jit(muon_optax.current_hyperparams, static_argnums=0) if jit else \
        muon_optax.current_hyperparams
    assert_hparams_close(read(tx, state), expected(4))
    # The same from the groups dict, and from a bare count.
    assert_hparams_close(muon_optax.current_hyperparams(groups(), state), expected(4))
    assert_hparams_close(muon_optax.current_hyperparams(tx, 7), expected(7))


def test_current_hyperparams_of_muon_and_adamw_constructors():
    tx = muon_optax.adamw(optax.linear_schedule(1.0, 0.0, 10), weight_decay=0.1)
    got = muon_optax.current_hyperparams(tx, tx.init({"b": jnp.ones(3)}))
    assert float(got["adamw"]["lr"]) == 1.0
    got = muon_optax.current_hyperparams(muon_optax.muon(0.02), np.int64(3))
    assert float(got["muon"]["momentum"]) == pytest.approx(0.95)


def test_current_hyperparams_bad_arguments():
    tx = muon_optax.adamw(1e-3)
    with pytest.raises(TypeError, match=r"current_hyperparams: pass the transformation made "
                                        r"by muon_adamw .*not one wrapped by optax\.chain"):
        muon_optax.current_hyperparams(optax.chain(optax.clip(1.0), tx), 0)
    state = optax.chain(optax.clip(1.0), tx).init({"b": jnp.ones(3)})
    with pytest.raises(TypeError, match=r"state must be the muon_adamw state .*state\[1\]"):
        muon_optax.current_hyperparams(tx, state)


NOT_NUMBERS = {
    "nan lr": (lambda: muon_optax.muon(float("nan")), "muon: lr must be a finite number"),
    "inf lr": (lambda: muon_optax.adamw(float("inf")), "adamw: lr must be a finite number"),
    "nan momentum": (lambda: muon_optax.muon(0.02, momentum=float("nan")),
                     "muon: momentum must be a finite number"),
    "inf beta as array": (lambda: muon_optax.adamw(1e-3, betas=(0.9, jnp.array(jnp.inf))),
                          "adamw: betas[1] must be a finite number"),
    "nan eps": (lambda: muon_optax.adamw(1e-3, eps=np.float32("nan")),
                "adamw: eps must be a finite number"),
    "nan in a group": (lambda: muon_optax.muon_adamw(
        {"m": dict(kind="muon", lr=0.02, weight_decay=float("nan"))}, lambda p: "m"),
        "group 'm': weight_decay must be a finite number"),
    "vector schedule": (lambda: muon_optax.muon(lambda count: jnp.full((3,), 0.02)),
                        "muon: lr is a schedule that returns an array of shape (3,)"),
    "max_grad_norm 0-d zero": (lambda: muon_optax.muon(0.02, max_grad_norm=jnp.array(0.0)),
                               "muon: max_grad_norm must be a positive number"),
    "max_grad_norm 0-d nan": (lambda: muon_optax.adamw(1e-3, max_grad_norm=jnp.array(jnp.nan)),
                              "adamw: max_grad_norm must be a positive number"),
    "max_grad_norm 0-d -1": (lambda: muon_optax.muon(0.02, max_grad_norm=jnp.array(-1.0)),
                             "muon: max_grad_norm must be a positive number"),
    "max_grad_norm inf": (lambda: muon_optax.muon(0.02, max_grad_norm=float("inf")),
                          "muon: max_grad_norm must be a positive number"),
    "injected nan": (lambda: optax.inject_hyperparams(muon_optax.adamw)(lr=jnp.nan).init(
        {"w": jnp.ones(3)}), "adamw: lr must be a finite number"),
}


@pytest.mark.parametrize("case", NOT_NUMBERS)
def test_hyperparameters_that_are_not_numbers_are_refused_naming_them(case):
    make, words = NOT_NUMBERS[case]
    with pytest.raises((ValueError, TypeError)) as info:
        make()
    assert str(info.value).startswith(words), str(info.value)


def test_traced_hyperparameters_pass_unchecked_and_keep_working():
    """Under jit (inject_hyperparams' update), a value is known only when the step runs:
    the constructors cannot check it, and a finite one trains as before."""
    params = {"w": jnp.ones((4, 3))}
    tx = optax.inject_hyperparams(muon_optax.muon, static_args=("ns_steps",))(
        lr=0.02, max_grad_norm=1.0)
    state = jax.jit(tx.init)(params)
    updates, _ = jax.jit(tx.update)(params, state, params)
    assert np.isfinite(np.asarray(updates["w"])).all()
    schedule = optax.linear_schedule(0.0, 0.02, 10)
    assert muon_optax.muon(schedule).init(params) is not None
