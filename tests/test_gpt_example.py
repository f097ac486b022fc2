"""The GPT example (examples/gpt/train.py), end to end on a tiny config, in-process.

``train.main(argv)`` runs in this process: conftest.py has already asked XLA for 8 CPU
devices, of which ``--devices 2`` takes two. Every run trains depth 1 (width 64), batches
of 4 x 32 bytes, 12 steps, on a ~40 KB corpus file written to a temporary directory.
The uninterrupted single-device run (``baseline``) keeps checkpoints of steps 4, 8 and
12, from which the cross-device resume test continues.
"""

import json
import shutil
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt"
for path in (EXAMPLE, REPO):  # the example's modules; benchmarks.common (HLO parser)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import parallel  # noqa: E402
import train  # noqa: E402

STEPS = 12
TINY = ["--depth", "1", "--seq-len", "32", "--batch-size", "4", "--steps", str(STEPS),
        "--eval-every", "6", "--eval-batches", "2", "--ckpt-every", "0", "--no-progress"]


def read_log(out):
    with open(Path(out) / "log.jsonl") as f:
        return [json.loads(line) for line in f]


def math_of(log):
    """The records without the timings: what must repeat exactly."""
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in log]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 KB of the example's sources, frozen in tests/data: the modes' curves are compared
    within float rounding, which tiny runs amplify differently on other text, so the
    corpus must not change when the example's code does."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes((Path(__file__).resolve().parent / "data" / "gpt_corpus.txt").read_bytes())
    assert path.stat().st_size == 40_000
    return path


def run(out, corpus, *extra):
    return train.main([*TINY, "--data", str(corpus), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("baseline")
    # Leftovers of an earlier run with --compare adamw: a fresh start removes them.
    (out / "adamw" / "ckpt" / "7").mkdir(parents=True)
    (out / "adamw" / "log.jsonl").write_text("{}\n")
    (out / "ckpt" / "9").mkdir(parents=True)
    assert run(out, corpus, "--ckpt-every", "4", "--keep-ckpts", "5") == 0
    return out, read_log(out)


def test_tiny_run_trains_and_writes_its_files(baseline):
    out, log = baseline
    assert [r["step"] for r in log] == list(range(STEPS + 1))
    assert set(log[0]) == {"step", "val_loss", "val_bpb"}            # the untrained model
    assert {"step", "loss", "lr_mult", "tokens_per_s"} <= set(log[1])
    val = [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
    assert [s for s, _ in val] == [0, 6, 12]
    assert val[0][1] == pytest.approx(np.log(256), abs=0.1)           # uniform over bytes
    assert val[-1][1] < val[0][1] - 1.0
    losses = [r["loss"] for r in log[1:]]
    assert np.mean(losses[-3:]) < losses[0] - 1.0
    assert all(np.isfinite(losses))
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "ckpt" / str(STEPS)).is_dir()                      # the final checkpoint
    assert sorted(int(p.name) for p in (out / "ckpt").iterdir()) == [4, 8, STEPS]
    assert not (out / "adamw").exists()                              # the earlier run's
    config = json.loads((out / "config.json").read_text())
    assert config["steps"] == STEPS and config["status"] == "finished"
    # The values used, not the command line's defaults (None, "1").
    assert config["warmup_steps"] == 1 and config["lr_scale"] == 1.0
    assert config["learning_rates"]["muon/matrix"] == 0.02
    assert config["learning_rates"]["muon/embed"] == pytest.approx(0.3 * (64 / 768) ** -0.5)
    assert config["steps_done"] == {"muon": STEPS} and config["params"] == 81_922
    assert log[1]["lr"] == pytest.approx(0.02 * log[1]["lr_mult"])   # the Muon group's lr


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="SIGINT handlers need the main thread")
def test_ctrl_c_saves_and_resume_repeats_the_run(baseline, corpus, tmp_path, monkeypatch,
                                                 capsys):
    original = train.ByteDataset.batch

    def batch(self, step):  # Ctrl-C while step 5 (index 4) is being prepared
        if step == 4:
            signal.raise_signal(signal.SIGINT)
        return original(self, step)

    monkeypatch.setattr(train.ByteDataset, "batch", batch)
    # --resume with nothing to resume: said in one line, then a fresh start.
    assert run(tmp_path, corpus, "--resume") == train.EXIT_INTERRUPTED
    out, err = capsys.readouterr()
    assert "--resume: no checkpoint in" in out and "starting from step 0" in out
    assert "interrupted (SIGINT): checkpoint of step 5 saved" in err
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["5"]
    assert read_log(tmp_path)[-1]["step"] == 5
    monkeypatch.undo()

    assert run(tmp_path, corpus, "--resume") == 0
    assert "resumed from" in capsys.readouterr().out
    assert math_of(read_log(tmp_path)) == math_of(baseline[1])       # bitwise the same run

    # A checkpoint resumes only the run that wrote it.
    assert run(tmp_path, corpus, "--resume", "--steps", "20") == train.EXIT_USAGE
    assert "steps=12 (now 20)" in capsys.readouterr().err


# The resid/x0 lambdas frozen: one device and N devices then differ by rounding only.
# At init every block is the identity (zero c_proj) and the final RMSNorm removes the
# residual stream's scale, so the lambdas' gradient is zero but for rounding (float64:
# 5.8e-10; float32: 4.7e-10 to 8.1e-10 by summation order, and by jax version: 0.12's tanh
# derivative in the logit softcap, (1+t)(1-t), differs from 0.10's by an ulp, and 0.12 with
# 0.10's rule repeats 0.10's curves to 1e-6).
# AdamW (eps 1e-10) makes of it a step of nearly lr whose size varies by up to 8%, and the
# loss curves of 4-device FSDP and one device drift by up to 1e-3 (seed 0) or 3e-2 (seed 4),
# on jax 0.10 and 0.12 alike. With --scalar-lr 1e-6: 3e-7 (seed 0) and 3e-6 (seed 4).
FROZEN_LAMBDAS = ("--scalar-lr", "1e-6")


@pytest.fixture(scope="module")
def frozen_one(tmp_path_factory, corpus):
    """The one-device run with the lambdas frozen: what the multi-device runs follow."""
    out = tmp_path_factory.mktemp("frozen_one")
    assert run(out, corpus, *FROZEN_LAMBDAS) == 0
    return read_log(out)


def test_two_devices_match_one_and_compare_adamw(frozen_one, corpus, tmp_path, capsys):
    assert run(tmp_path, corpus, "--devices", "2", "--compare", "adamw", *FROZEN_LAMBDAS) == 0
    assert "sharded MuonAdamW" in capsys.readouterr().out
    one, two = frozen_one, read_log(tmp_path)
    assert [r["step"] for r in two] == [r["step"] for r in one]
    # Same global batch: the same curve up to float rounding (measured on jax 0.10 and 0.12:
    # 3.8e-7 train, 3.4e-7 val at most).
    np.testing.assert_allclose([r["loss"] for r in two[1:]], [r["loss"] for r in one[1:]],
                               rtol=1e-5)
    np.testing.assert_allclose([r["val_loss"] for r in two if "val_loss" in r],
                               [r["val_loss"] for r in one if "val_loss" in r], rtol=1e-5)
    adamw = read_log(tmp_path / "adamw")
    assert adamw[0]["val_loss"] == pytest.approx(one[0]["val_loss"])   # the same init
    assert adamw[-1]["val_loss"] < adamw[0]["val_loss"]


def test_fsdp_follows_one_device_and_compare_adamw(frozen_one, corpus, tmp_path, capsys):
    assert run(tmp_path, corpus, "--devices", "4", "--fsdp", "--compare", "adamw",
               *FROZEN_LAMBDAS) == 0
    out = capsys.readouterr().out
    assert "FSDP: params, grads and MuonAdamW state sharded" in out
    # Per device a quarter of the params and grads (the two 1-element lambdas whole).
    assert "params 81.9 kB + grads 81.9 kB" in out
    one, fsdp = frozen_one, read_log(tmp_path)
    assert fsdp[0]["val_loss"] == pytest.approx(one[0]["val_loss"], rel=1e-6)  # the same init
    assert [r["step"] for r in fsdp] == [r["step"] for r in one]
    # The same global batch: the same curve up to rounding (measured on jax 0.10 and 0.12:
    # 3.1e-7 train, 4.3e-7 val at most).
    np.testing.assert_allclose([r["loss"] for r in fsdp[1:]], [r["loss"] for r in one[1:]],
                               rtol=1e-5)
    np.testing.assert_allclose([r["val_loss"] for r in fsdp if "val_loss" in r],
                               [r["val_loss"] for r in one if "val_loss" in r], rtol=1e-5)
    adamw = read_log(tmp_path / "adamw")
    assert adamw[0]["val_loss"] == fsdp[0]["val_loss"]
    assert adamw[-1]["val_loss"] < adamw[0]["val_loss"] - 1.0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mode"] == "FSDP" and config["devices"] == 4 and config["fsdp"]


def test_muon_blocks_on_fsdp_follow_one_device(frozen_one, corpus, tmp_path, capsys):
    """--muon-blocks groups:2 (4 heads of 16: two blocks per attention kernel): one
    device and FSDP on 2 devices (c_proj's input blocks split on their boundary) take
    the same steps, and not nanochat's."""
    blocks = ("--head-dim", "16", "--muon-blocks", "groups:2", *FROZEN_LAMBDAS)
    assert run(tmp_path / "one", corpus, *blocks) == 0
    assert run(tmp_path / "fsdp", corpus, *blocks, "--devices", "2", "--fsdp") == 0
    assert run(tmp_path / "none", corpus, "--head-dim", "16", *FROZEN_LAMBDAS) == 0
    capsys.readouterr()
    one, fsdp, none = (read_log(tmp_path / d) for d in ("one", "fsdp", "none"))
    np.testing.assert_allclose([r["loss"] for r in fsdp[1:]], [r["loss"] for r in one[1:]],
                               rtol=1e-5)
    assert one[0]["val_loss"] == none[0]["val_loss"]       # the same init
    assert abs(one[-1]["val_loss"] - none[-1]["val_loss"]) > 1e-4
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    assert config["muon_blocks"] == "groups:2"


def _keep_checkpoints_up_to(out, step):
    for ckpt in (Path(out) / "ckpt").iterdir():
        if int(ckpt.name) > step:
            shutil.rmtree(ckpt)


def test_resume_moves_between_device_counts_and_modes(baseline, corpus, tmp_path, capsys):
    """1 device -> FSDP on 2 -> ZeRO-2 on 4, through the portable checkpoints, follows
    the uninterrupted single-device run; and an FSDP checkpoint resumed in FSDP on as
    many devices repeats that run bit for bit."""
    out = tmp_path / "out"
    shutil.copytree(baseline[0], out)
    _keep_checkpoints_up_to(out, 4)
    every = ("--ckpt-every", "4")
    assert run(out, corpus, "--resume", "--devices", "2", "--fsdp", *every) == 0
    assert ("(step 4; written on 1 device (one device), continued on 2 devices (FSDP))"
            in capsys.readouterr().out)
    fsdp = read_log(out)

    _keep_checkpoints_up_to(out, 8)                                     # FSDP's step 8
    assert run(out, corpus, "--resume", "--devices", "2", "--fsdp", *every) == 0
    assert "(step 8)" in capsys.readouterr().out                       # the same mode
    assert math_of(read_log(out)) == math_of(fsdp)                      # bitwise

    _keep_checkpoints_up_to(out, 8)
    assert run(out, corpus, "--resume", "--devices", "4") == 0
    assert ("(step 8; written on 2 devices (FSDP), continued on 4 devices (ZeRO-2))"
            in capsys.readouterr().out)
    hopped, one = read_log(out), baseline[1]
    assert [r["step"] for r in hopped] == list(range(STEPS + 1))
    assert math_of(hopped[:5]) == math_of(one[:5])                     # from the checkpoint
    # Continued in other modes: rounding only (measured: 1e-7).
    np.testing.assert_allclose([r["loss"] for r in hopped[5:]], [r["loss"] for r in one[5:]],
                               rtol=1e-5)
    np.testing.assert_allclose(hopped[-1]["val_loss"], one[-1]["val_loss"], rtol=1e-5)

    # Other settings are still refused, with any device count and mode.
    assert run(out, corpus, "--resume", "--fsdp", "--devices", "2",
               "--matrix-lr", "0.03") == train.EXIT_USAGE
    assert "matrix_lr=0.02 (now 0.03)" in capsys.readouterr().err


def test_fsdp_train_step_splits_everything_and_moves_muon_by_all_to_all(corpus, tmp_path):
    """The compiled --fsdp --devices 4 step: each device holds a quarter of the params
    and about a quarter of the optimizer state (as muon_optax.estimate says); the
    forward pass all-gathers each split param once, and the optimizer's only traffic is
    two all-to-alls (Muon matrices to their owners and back), no all-gather."""
    import jax

    from benchmarks.common import collectives, per_device_bytes

    n = 4
    args = train.build_parser().parse_args(
        [*TINY, "--data", str(corpus), "--out", str(tmp_path), "--devices", str(n), "--fsdp"])
    ctx = train._setup(args, train._load_data(args), [])
    tx, sharded = train._make_tx(ctx, "muon", ctx.abstract_params)
    steps = train._build_steps(ctx, tx, sharded)
    params = ctx.init_params()
    state = steps.init(params)
    leaves = jax.tree.leaves(params)
    split = [x for x in leaves if x.ndim >= 2]
    small = sum(x.nbytes for x in leaves if x.ndim < 2)               # the lambdas: whole
    assert per_device_bytes(params, ctx.devices) == [sum(x.nbytes for x in split) // n
                                                     + small] * n
    one = single_device_state_bytes(ctx)
    held = per_device_bytes(state, ctx.devices)
    assert held == [ctx.estimate.state["muon"]] * n
    # Whole matrices have owners: at most a quarter plus one (64, 256) matrix's state.
    assert held[0] <= one / n + 64 * 256 * 4 + 256 * 4, (held, one)

    x, y = ctx.dataset.batch(0)
    compiled = steps.train.lower(params, state, ctx.place.batch(x), ctx.place.batch(y)).compile(
        {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True})
    ops = collectives(compiled.as_text(), n)
    assert ops["all-to-all"]["count"] == 2, ops
    assert ops["all-gather"]["elements"] == sum(x.size for x in split), ops
    # The gradients' reduction (XLA:CPU: an all-reduce and a slice; GPU/TPU backends form
    # a reduce-scatter), and the loss.
    reduced = sum(ops.get(k, {}).get("elements", 0) for k in ("all-reduce", "reduce-scatter"))
    assert reduced <= sum(x.size for x in leaves) + 8, ops
    assert set(ops) <= {"all-to-all", "all-gather", "all-reduce", "reduce-scatter"}, ops


def single_device_state_bytes(ctx):
    """The single-device MuonAdamW state's bytes, from shapes."""
    import jax
    from optim_setup import make_optimizer

    single = make_optimizer(ctx.abstract_params, ctx.cfg, total_steps=ctx.args.steps)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(single.init, ctx.abstract_params)))


def test_gradients_inside_shard_map_are_each_devices_own():
    """Inside shard_map, jax.grad at the replicated params would return the gradient
    summed over the devices (an all-reduce in the backward pass, then N times the mean
    once the optimizer averages again). The example's step hands the optimizer each
    device's own gradient, and the loss it logs is the global batch's mean."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    n = 4
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.arange(4.0) / 4}
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 3))
    y = jax.random.normal(jax.random.PRNGKey(1), (8, 4))

    def loss_of(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

    def per_device(p, x, y):
        loss, grads = parallel.local_value_and_grad(loss_of, p, x, y, "data")
        return loss, jax.tree.map(lambda g: g[None], grads)  # device d's gradient: row d

    loss, grads = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                        out_specs=(P(), P("data"))))(params, x, y)
    want_loss, want = jax.value_and_grad(loss_of)(params, x, y)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    rows = len(x) // n
    for k in params:
        np.testing.assert_allclose(grads[k].mean(0), want[k], rtol=1e-5, atol=1e-7, err_msg=k)
        for d in range(n):
            own = jax.grad(loss_of)(params, x[d * rows:(d + 1) * rows], y[d * rows:(d + 1) * rows])
            np.testing.assert_allclose(grads[k][d], own[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_sharded_train_step_does_not_all_reduce_the_gradients(corpus, tmp_path):
    """The compiled train step of --devices 2: the gradients are reduce-scattered once
    (ZeRO-2); the only all-reduces are of the small params (< 1024 elements) and the loss."""
    import re

    args = train.build_parser().parse_args(
        [*TINY, "--data", str(corpus), "--out", str(tmp_path), "--devices", "2"])
    ctx = train._setup(args, train._load_data(args), [])
    tx, sharded = train._make_tx(ctx, "muon", ctx.abstract_params)
    steps = train._build_steps(ctx, tx, sharded)
    params = ctx.init_params()
    x, y = ctx.dataset.batch(0)
    hlo = steps.train.lower(params, steps.init(params), ctx.place.batch(x),
                            ctx.place.batch(y)).compile().as_text()
    reduced = [shape for line in hlo.splitlines()
               for result in re.findall(r"= (.*?) all-reduce(?:-start)?\(", line)
               for shape in re.findall(r"\[([\d,]*)\]", result)]
    sizes = [int(np.prod([int(d) for d in s.split(",") if d])) for s in reduced]
    assert sizes and max(sizes) < 1024, sizes
    assert re.search(r" reduce-scatter(?:-start)?\(", hlo)


def test_missing_data_path_is_a_clear_error(tmp_path, capsys):
    assert train.main(["--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "does not exist" in err and "Traceback" not in err


def test_too_small_corpus_is_a_clear_error(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("hello world\n" * 20)
    assert train.main(["--data", str(small), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "too small" in err and "Traceback" not in err


def test_batch_must_split_over_the_devices(corpus, tmp_path, capsys):
    assert run(tmp_path, corpus, "--devices", "3") == 2
    assert "not divisible by --devices 3" in capsys.readouterr().err
