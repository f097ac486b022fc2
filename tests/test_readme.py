"""The snippets of README.md and docs/ run as pasted: quickstart, ZeRO-2 (and what continues it: the
estimate, the move to one device), FSDP, the optax.contrib.muon switch, nnx.Optimizer."""

import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import muon_optax

try:
    from . import sharded_problem as sp
except ImportError:
    import sharded_problem as sp

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [b for doc in DOCS for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)]


def block(marker: str) -> str:
    """The one python block of the README or docs/ containing ``marker``."""
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, (marker, len(found))
    return found[0]


def run(*codes: str) -> dict:
    namespace = {}
    for i, code in enumerate(codes):
        exec(compile(code, f"README.md snippet {i}", "exec"), namespace)
    return namespace


def test_quickstart_runs():
    # One step from the snippet's params: AdamW's first step is lr times the sign of the
    # gradient (the embedding and the 1-D scale), Muon moves the matrices by a finite step.
    ns = run(block("# other >=2-D -> \"muon\""))
    params = ns["params"]
    assert int(ns["state"].count) == 1
    np.testing.assert_allclose(params["embed"], -3e-3, rtol=1e-5)
    np.testing.assert_allclose(params["scale"], 1 - 3e-3, rtol=1e-5)
    for name, before in (("w1", 1 / 8), ("w2", 1 / 16)):
        step = np.asarray(params[name]) - before
        assert np.isfinite(step).all() and 1e-3 < np.abs(step).max() < 0.1, name


def test_zero2_snippet_and_its_continuations_run():
    assert jax.device_count() == 8  # conftest's simulated devices: the mesh snippet uses all
    ns = run(block("state = jax.jit(jax.shard_map(tx.init"), block("muon_optax.estimate("),
             block("state1 = muon_optax.import_state("))
    assert len(ns["est"]["state_bytes"]) == 256
    assert jax.tree.structure(ns["state1"]) == jax.tree.structure(ns["one"].init(ns["params"]))


def test_zero2_snippet_step_equals_one_device_on_the_global_batch():
    # The snippet as pasted, its last line (the step) run apart: the params before it are
    # the one-device step's starting point.
    code = block("state = jax.jit(jax.shard_map(tx.init")
    setup, last = code.rstrip().rsplit("\n", 1)
    assert last.startswith("params, state = step("), last
    ns = run(setup)
    before = ns["params"]
    exec(compile(last, "README.md ZeRO-2 step", "exec"), ns)
    one = muon_optax.muon_adamw(ns["groups"], muon_optax.label_by_path([("embed", "adamw")]))
    grads = jax.grad(ns["loss_fn"])(before, ns["tokens"])   # the mean over the global batch
    updates, _ = one.update(grads, one.init(before), before)
    expected = optax.apply_updates(before, updates)
    for k in expected:
        change = np.asarray(expected[k]) - np.asarray(before[k])
        np.testing.assert_allclose(np.asarray(ns["params"][k]) - np.asarray(before[k]), change,
                                   rtol=0, atol=1e-5 * np.abs(change).max(), err_msg=k)


def test_contrib_snippet_runs():
    ns = run(block("muon_optax.contrib_muon(learning_rate=0.02, weight_decay=0.1, preconditioning"))
    assert "params" in ns and "state" in ns


def test_fsdp_snippet_runs_and_keeps_the_split():
    ns = run(block("specs = {\"embed\": P(\"data\")"))
    specs = {k: tuple(v.sharding.spec) for k, v in ns["params"].items()}
    assert specs["w2"] == (None, "data") and specs["embed"][0] == "data", specs
    n = ns["mesh"].shape["data"] if "mesh" in ns else 8
    for leaf in jax.tree.leaves(ns["state"].muon):   # 1-D, each device its 1/N share
        shard = leaf.addressable_shards[0].data
        assert leaf.sharding.spec[0] == "data" and shard.shape[0] * n == leaf.shape[0]


def test_zero2_accumulation_snippet_equals_one_device_on_all_micro_batches():
    """The ZeRO-2 snippet (its own step left out), then the accumulation snippet: one
    device's step on all k micro-batches at once."""
    setup, last = block("state = jax.jit(jax.shard_map(tx.init").rstrip().rsplit("\n", 1)
    ns = run(setup)
    before = ns["params"]
    exec(compile(block("def accumulating_step("), "README.md accumulation", "exec"), ns)
    one = muon_optax.muon_adamw(ns["groups"], muon_optax.label_by_path([("embed", "adamw")]))
    micro = ns["micro_tokens"]
    grads = jax.grad(ns["loss_fn"])(before, micro.reshape(-1, micro.shape[-1]))
    expected = optax.apply_updates(before, one.update(grads, one.init(before), before)[0])
    for k in expected:
        change = np.asarray(expected[k]) - np.asarray(before[k])
        np.testing.assert_allclose(np.asarray(ns["params"][k]) - np.asarray(before[k]), change,
                                   rtol=0, atol=1e-5 * np.abs(change).max(), err_msg=k)


def _without_key_bias(model) -> dict:
    """Params by path, less the attention's key bias (softmax ignores it: its gradient is
    rounding noise, which Adam turns into full steps)."""
    from flax import nnx

    flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(nnx.state(model, nnx.Param)))[0]
    return {muon_optax.path_str(p): np.asarray(x) for p, x in flat
            if not muon_optax.path_str(p).endswith("key/bias")}


def test_nnx_optimizer_snippets_one_device_fsdp_auto_and_explicit_checkpoint():
    """The nnx.Optimizer snippets as pasted: one device; FSDP with mesh= on an Explicit
    and (one word changed) an Auto mesh, whose step is the one-device step; then the
    portable checkpoint onto one device, whose next step is the mesh's."""
    from flax import nnx

    one = block("optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)\nmuon_optax.describe")
    fsdp = block("def fsdp_loss(")
    ns = run(one)
    want = _without_key_bias(ns["model"])
    for axis_type in ("Explicit", "Auto"):
        ns = run(one, fsdp.replace("AxisType.Explicit", f"AxisType.{axis_type}"))
        got = _without_key_bias(ns["model"])
        for path, value in want.items():
            np.testing.assert_allclose(got[path], value, rtol=1e-4, atol=1e-6, err_msg=path)
        for leaf in jax.tree.leaves(nnx.as_pure(ns["optimizer"].opt_state).muon):
            assert leaf.sharding.spec[0] == "data", axis_type
    exec(compile(block("muon_optax.load_nnx_optimizer_state("), "README.md nnx checkpoint",
                 "exec"), ns)
    assert int(ns["optimizer1"].step[...]) == 2      # the mesh's step, then the snippet's
    with jax.set_mesh(ns["mesh"]):                    # the same second step on the mesh
        ns["fsdp_step"](ns["model"], ns["optimizer"], ns["tokens"])
        on_mesh = ns["fsdp_step"](ns["model"], ns["optimizer"], ns["tokens"])
    moved = ns["train_step"](ns["model1"], ns["optimizer1"], ns["tokens"])
    np.testing.assert_allclose(float(moved), float(on_mesh), rtol=1e-5)


def test_blocks_snippet_runs_and_cuts_as_its_comments_say():
    ns = run(block("D = muon_optax.MuonDimensionNumbers"))
    tx, params = ns["tx"], ns["params"]
    rows = {r["path"]: r for r in muon_optax.describe(tx, params)}
    heads, group, d = ns["heads"], ns["group"], ns["d"]
    assert (rows["c_q"]["matrices"], rows["c_q"]["matrix"]) == (heads, (d // heads, d))
    assert rows["c_k"]["matrices"] == heads // group
    assert (rows["qkv"]["matrices"], rows["qkv"]["matrix"]) == (3, (d, d))
    assert rows["gate_up"]["matrices"] == 2
    assert (rows["c_proj"]["matrices"], rows["c_proj"]["matrix"]) == (heads, (d, d // heads))
    assert rows["experts"]["matrices"] == 4
    grads = jax.tree.map(lambda x: x + 0.01, params)
    updates, _ = tx.update(grads, ns["state"], params)
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


def test_optax_move_snippet_continues_and_returns():
    ns = run(block("as_optax=True)   # and back to optax"))
    assert jax.tree.structure(ns["back"]) == jax.tree.structure(ns["theirs"].init(ns["params"]))
    assert int(ns["back"].inner_states["muon"].inner_state[0].count) == 3
    assert int(ns["state"].count) == 2


def test_torch_muon_snippet_runs_and_equals_torch_where_installed():
    """The snippet's matrices step as torch.optim.Muon's (with a float32 iteration, where
    torch is installed); its biases as AdamW's first step (lr times the gradient's sign)."""
    code = block("muon_optax.torch_muon(lr=0.02")
    setup, last = code.rstrip().rsplit("\n", 1)
    ns = run(setup)
    before = ns["params"]
    exec(compile(last, "docs torch_muon snippet", "exec"), ns)
    for name in ("fc", "proj"):
        np.testing.assert_allclose(ns["params"][name]["bias"],
                                   -3e-4 * np.sign(ns["grads"][name]["bias"]), atol=1e-6)
    pytest.importorskip("torch")
    from test_torch_muon import run_torch

    flat = {name: before[name]["weight"] for name in ("fc", "proj")}
    want = run_torch(flat, 1, dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                     float32=True, grads_of=lambda t: {k: ns["grads"][k]["weight"] for k in flat})
    for name in flat:
        change = want[name] - np.asarray(flat[name])
        diff = np.asarray(ns["params"][name]["weight"]) - want[name]
        assert np.linalg.norm(diff) <= 1e-4 * np.linalg.norm(change), name


def test_testing_guide_chex_test_runs_and_shift_is_only_noise():
    # docs/testing.md's test as pasted; what it leaves out differs by about lr (its
    # gradient is rounding noise: the runs disagree on the sign of each step).
    ns = run(block("chex.assert_trees_all_close("))
    grad = jax.grad(ns["loss_fn"])(ns["params"], ns["tokens"])
    assert float(np.abs(grad["shift"]).max()) < 1e-8
    apart = np.asarray(ns["eight"]["shift"]) - np.asarray(ns["one"]["shift"])
    assert float(np.abs(apart).max()) > 1e-4


@pytest.mark.parametrize("limit, group", [(None, None), (4, None), (4, 1)])
def test_zero2_snippet_in_the_tpu_forms_steps_as_the_cpu_form(monkeypatch, limit, group):
    """The ZeRO-2 snippet as pasted (``jax.grad`` inside the ``shard_map``'d step) with
    every TPU form forced on XLA:CPU: its embedding, split over the devices, is stepped
    after the Muon matrices and waits for an element of each Muon update (the barrier
    and ordering the TPU compiler gets); the step is the CPU form's, bit for bit. With the
    all-gather limit lowered under the device count (``limit``), the forms past it: the
    directions summed by device groups (``group`` devices each; one: the owners' rows in groups
    of their own, which the others send zeros), the AdamW updates gathered flat."""
    from muon_optax.rule import order, platform
    from muon_optax.step import engine, transport

    code = block("state = jax.jit(jax.shard_map(tx.init")
    want = run(code)["params"]
    waited, groups = [], []
    monkeypatch.setattr(engine, "first_elements",
                        lambda xs: waited.append(len(xs)) or order.first_elements(xs))
    if limit is not None:
        groups = sp.lower_all_gather_limit(monkeypatch, limit)
    if group is not None:
        monkeypatch.setattr(transport, "PIECE_MATRICES", group)
        monkeypatch.setattr(transport, "PIECE_ELEMENTS", 0)   # else one group of 8
    for site in sp.TPU_SITES:
        monkeypatch.setitem(platform.FORCED, site, "tpu")
    got = run(code)["params"]
    assert waited == [2]              # after w1's and w2's updates
    assert bool(groups) == (limit is not None), groups
    assert group is None or groups == [group], groups
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
