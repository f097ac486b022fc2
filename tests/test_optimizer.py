"""muon_adamw against the independent float64 reference (tests/reference.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax
from muon_optax import MuonDimensionNumbers

try:
    from . import reference
except ImportError:  # plain `pytest` rootdir imports
    import reference

TORCH_LAYOUT = MuonDimensionNumbers(reduction_axis=1, output_axis=0)


def adamw_group(**kw):
    return dict(kind="adamw", lr=optax.linear_schedule(0.01, 0.002, 10), betas=(0.8, 0.95),
                eps=1e-10, weight_decay=optax.cosine_decay_schedule(0.1, 10)) | kw


def muon_group(**kw):
    return dict(kind="muon", lr=optax.linear_schedule(0.02, 0.005, 10),
                momentum=optax.linear_schedule(0.85, 0.95, 10), ns_steps=5,
                beta2=optax.linear_schedule(0.9, 0.95, 10), weight_decay=0.2,
                compute_dtype=jnp.float32) | kw


def random_tree(shapes, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return {name: (0.5 * jax.random.normal(k, s)).astype(dtype)
            for k, (name, s) in zip(keys, sorted(shapes.items()))}


def run_both(shapes, groups, labels, *, steps=10, dims=None, layouts=None,
             dtype=jnp.float32, seed=0):
    """Runs both optimizers on the same gradients; returns per-step param changes."""
    params = random_tree(shapes, seed, dtype)
    tx = muon_optax.muon_adamw(groups, labels, dimension_numbers=dims)
    state = tx.init(params)
    update = jax.jit(tx.update)
    ref = reference.ReferenceMuonAdamW(groups, labels, layouts)
    ref_params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    changes = []
    for step in range(steps):
        grads = random_tree(shapes, seed + 100 + step, dtype)
        updates, state = update(grads, state, params)
        new = optax.apply_updates(params, updates)
        ref_new = ref.step(ref_params, {k: np.asarray(v, np.float64) for k, v in grads.items()})
        changes.append(({k: np.asarray(new[k], np.float64) - ref_params[k] for k in new},
                        {k: ref_new[k] - ref_params[k] for k in new},
                        {k: float(jnp.finfo(dtype).eps) * np.abs(ref_params[k]) for k in new}))
        # Both continue from the library's params (rounded to the param dtype), so the
        # comparison measures one step's error, not an accumulated drift.
        params, ref_params = new, {k: np.asarray(v, np.float64) for k, v in new.items()}
    return changes


def assert_changes_close(changes, rtol):
    """Relative error of each step's parameter change under ``rtol``.

    Storing the new parameter rounds it to its dtype, so one rounding step of the
    parameter (half an ulp) is allowed on top: a change that nearly cancels (decay
    against the step) cannot be stored more exactly than that.
    """
    for step, (got, want, ulp) in enumerate(changes):
        for k in want:
            err = np.linalg.norm(got[k] - want[k])
            allowed = rtol * np.linalg.norm(want[k]) + 0.5 * np.linalg.norm(ulp[k])
            rel = err / max(np.linalg.norm(want[k]), 1e-30)
            assert err <= allowed, f"step {step}, {k}: relative error {rel:.2e} > {rtol}"


MIXED = {"embed": (96, 16), "bias": (16,), "scalar": (), "head": (16, 40),
         "wide": (16, 48), "tall": (48, 16), "square": (32, 32), "square2": (32, 32),
         "square3": (16, 16)}
MIXED_LABELS = {"embed": "embed", "bias": "scalars", "scalar": "scalars", "head": "head",
                "wide": "matrix", "tall": "matrix", "square": "matrix", "square2": "matrix",
                "square3": "matrix2"}


def mixed_groups(**muon_kw):
    return {"embed": adamw_group(), "head": adamw_group(lr=0.004, weight_decay=0.0),
            "scalars": adamw_group(betas=(0.9, 0.99)), "matrix": muon_group(**muon_kw),
            "matrix2": muon_group(lr=0.01, **muon_kw)}


def test_mixed_tree_matches_reference():
    assert_changes_close(run_both(MIXED, mixed_groups(), MIXED_LABELS), 1e-5)


@pytest.mark.parametrize("row_equilibration", [True, False])
@pytest.mark.parametrize("renormalize", [True, False])
def test_muon_options_match_reference(row_equilibration, renormalize):
    groups = mixed_groups(row_equilibration=row_equilibration, renormalize=renormalize)
    assert_changes_close(run_both(MIXED, groups, MIXED_LABELS, steps=10), 1e-5)


@pytest.mark.parametrize("ns_steps", [1, 2, 3, 4, 5])
def test_ns_steps_match_reference(ns_steps):
    shapes = {"wide": (16, 48), "tall": (40, 24), "square": (24, 24)}
    labels = dict.fromkeys(shapes, "m")
    changes = run_both(shapes, {"m": muon_group(ns_steps=ns_steps)}, labels)
    assert_changes_close(changes, 1e-5)


@pytest.mark.parametrize("polar_method", ["direct", "gram"])
def test_large_matrices_match_reference(polar_method):
    # Bigger matrices: float32 matmul rounding grows; cautious decay off so a float32
    # sign flip of O*P near zero does not count as an error.
    shapes = {"wide": (128, 512), "tall": (512, 128), "square": (256, 256)}
    labels = dict.fromkeys(shapes, "m")
    groups = {"m": muon_group(weight_decay=0.0, polar_method=polar_method)}
    changes = run_both(shapes, groups, labels, steps=4)
    assert_changes_close(changes, 5e-5)


def test_large_adamw_matches_reference():
    shapes = {"big": (512, 300), "small": (7,)}
    changes = run_both(shapes, {"a": adamw_group()}, dict.fromkeys(shapes, "a"))
    assert_changes_close(changes, 1e-6)


def test_torch_layout_matches_reference():
    shapes = {"wide": (16, 48), "tall": (48, 16), "square": (16, 16)}
    labels = dict.fromkeys(shapes, "m")
    layouts = dict.fromkeys(shapes, ((1,), (0,)))
    changes = run_both(shapes, {"m": muon_group()}, labels, dims=TORCH_LAYOUT,
                       layouts=layouts)
    assert_changes_close(changes, 1e-5)


def test_batch_axes_and_multi_axis_matrices_match_reference():
    shapes = {"layers": (3, 16, 48), "heads": (16, 4, 8), "plain": (48, 16)}
    dims = {"layers": None, "plain": None,
            "heads": MuonDimensionNumbers(reduction_axis=0, output_axis=(1, 2))}
    layouts = {"heads": ((0,), (1, 2))}
    changes = run_both(shapes, {"m": muon_group()}, dict.fromkeys(shapes, "m"), dims=dims,
                       layouts=layouts)
    assert_changes_close(changes, 1e-5)


def test_bf16_params_match_reference():
    changes = run_both(MIXED, mixed_groups(), MIXED_LABELS, dtype=jnp.bfloat16)
    # bf16 parameters round every change to 8 bits of mantissa.
    assert_changes_close(changes, 1e-2)


def test_flax_layout_update_is_transpose_of_torch_layout():
    """To float32 rounding, not bit for bit: a tall and a wide stack sum the products of
    the polar iteration in other orders (jax 0.12.1's XLA:CPU differs by ~2e-8 op by op,
    0.10.2's under jit). A wrong axis (NorMuon's, MuonEq's, the stored orientation) or a
    flipped decay mask moves an update by 1e-4 or more."""
    shapes = {"w": (24, 40), "v": (40, 24)}
    params = random_tree(shapes)
    grads = random_tree(shapes, seed=1)
    groups = {"m": muon_group()}
    labels = dict.fromkeys(shapes, "m")
    flax_tx = muon_optax.muon_adamw(groups, labels)
    torch_tx = muon_optax.muon_adamw(groups, labels, dimension_numbers=TORCH_LAYOUT)
    t = lambda tree: jax.tree.map(jnp.transpose, tree)  # noqa: E731
    u_flax, _ = flax_tx.update(grads, flax_tx.init(params), params)
    u_torch, _ = torch_tx.update(t(grads), torch_tx.init(t(params)), t(params))
    chex.assert_trees_all_close(u_flax, t(u_torch), rtol=0, atol=1e-7)


def test_several_shapes_in_one_group_are_stacked():
    params = random_tree({"a": (16, 48), "b": (48, 16), "c": (16, 16), "d": (2, 16, 16)})
    tx = muon_optax.muon_adamw({"m": muon_group()}, lambda p: jax.tree.map(lambda _: "m", p))
    info = tx.init.stack_info(params)
    # Each stored as laid out: a (16, 48) and a (48, 16) stack; the squares together.
    assert [(s["shape"], s["size"]) for s in info] == [((16, 48), 1), ((48, 16), 1),
                                                       ((16, 16), 3)]


def _two_stack_problem():
    """A nanochat block's Muon matrices, two layers: (64, 256), (64, 64) and (256, 64)
    stacks."""
    shapes = {f"{i}.{n}": s for i in range(2)
              for n, s in [("q", (64, 64)), ("k", (64, 64)), ("v", (64, 64)), ("o", (64, 64)),
                           ("fc", (64, 256)), ("proj", (256, 64))]}
    params = random_tree(shapes)
    tx = muon_optax.muon_adamw({"m": muon_group()}, lambda p: jax.tree.map(lambda _: "m", p))
    return params, tx


def test_nan_gradient_stays_in_its_stack():
    # Stacks are sequenced by a data dependency (order.after); it must carry no values.
    params, tx = _two_stack_problem()
    info = tx.init.stack_info(params)
    first = info[0]["members"][0]
    assert [i["shape"] for i in info] == [(64, 256), (64, 64), (256, 64)]
    grads = random_tree({k: v.shape for k, v in params.items()}, seed=1)
    bad = dict(grads, **{first: grads[first].at[0, 0].set(jnp.nan)})
    update = jax.jit(tx.update)   # one compile for both (eager: about 10 s a call)
    clean, _ = update(grads, tx.init(params), params)
    dirty, _ = update(bad, tx.init(params), params)
    for name in info[1]["members"]:
        chex.assert_trees_all_equal(dirty[name], clean[name])
    assert np.isnan(np.asarray(dirty[first])).all()


def test_stacks_temporaries_are_not_alive_together():
    # Without sequencing, XLA interleaves the two stacks' polar iterations and keeps both
    # sets of buffers: 3.25x the largest stack's gradient bytes here; 2.06x with it. With
    # the momentum a slice of a buffer shared by the stacks, XLA copied it: 2.56x.
    params, tx = _two_stack_problem()

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params),
                                                          params).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    per_kind: dict = {}   # fc (64, 256) and proj (256, 64): stacks of one kind of matrix
    for i in tx.init.stack_info(params):
        kind = tuple(sorted(i["shape"]))
        per_kind[kind] = per_kind.get(kind, 0) + i["size"] * i["shape"][0] * i["shape"][1] * 4
    largest = max(per_kind.values())
    assert temp <= 2.25 * largest, temp / largest
