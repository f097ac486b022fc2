"""Train a nanochat-style GPT (Flax NNX) with muon_optax's MuonAdamW, on one device or a mesh.

    python examples/gpt/train.py                       # the default run: ~3 min on 2 CPU cores
    python examples/gpt/train.py --compare adamw       # + the same model with optax.adamw
    python examples/gpt/train.py --devices 4           # data-parallel, ZeRO-2 optimizer
    python examples/gpt/train.py --resume              # continue from the last checkpoint
    python examples/gpt/train.py --data my_texts/ --depth 6 --steps 2000

Everything lands under ``--out`` (default ``runs/gpt``):

    config.json        the run's settings
    log.jsonl          one record per step: step, loss, lr_mult, tokens_per_s, and
                       val_loss / val_bpb at every evaluation (step 0 holds only the
                       validation numbers of the untrained model)
    loss.png           the loss curves (train and validation; both optimizers with --compare)
    ckpt/<step>/       orbax checkpoints: params, optimizer state, step (= data position)
    adamw/             with --compare adamw: the AdamW run's log.jsonl and ckpt/

The data is a pure function of the step (``ByteDataset.batch(step)``), so a checkpoint
needs only the step to continue the data stream, and ``--resume`` reproduces the loss
sequence of an uninterrupted run. Ctrl-C saves a checkpoint at the current step and exits
(status 130); a second Ctrl-C aborts at once.

``--devices N`` (N > 1) trains data-parallel on an N-device mesh: the train step runs
inside ``jax.shard_map``, each device computes the gradients of its ``batch_size / N``
rows, and ``muon_optax``'s sharded MuonAdamW (ZeRO-2) reduce-scatters them, updates the
share of the state each device owns and all-gathers the updates. On CPU the N devices are
simulated (``XLA_FLAGS=--xla_force_host_platform_device_count``, set here before jax is
imported). ``--distributed`` runs the same step over every device of every process
(``jax.distributed.initialize()``; one process per host).

``main(argv)`` runs in-process too (the tests do); jax is imported only after the
arguments are parsed, so that the simulated device count can still be set.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # model.py, data.py, optim_setup.py sit beside this file
    sys.path.insert(0, str(HERE))
if importlib.util.find_spec("muon_optax") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parents[1]))

from data import VOCAB_SIZE, ByteDataset, bits_per_byte  # noqa: E402  (numpy only, no jax)

# The default run: ~3 minutes on 2 idle CPU cores (see the notes in the README section).
DEFAULT_DEPTH = 3
DEFAULT_BATCH = 8
DEFAULT_SEQ_LEN = 256
DEFAULT_STEPS = 600
DEFAULT_EVAL_EVERY = 100
DEFAULT_EVAL_BATCHES = 16
# optax.adamw's learning rate for --compare adamw, from a sweep on the default config
# (1e-3, 3e-3, 5e-3, 1e-2 -> val loss 1.929, 1.735, 1.699, 1.737 at 600 steps; same
# warmup and warmdown as MuonAdamW).
DEFAULT_ADAMW_LR = 5e-3

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


class UsageError(Exception):
    """A problem with the command line or the data: reported as one line, exit status 2."""


# ----------------------------------------------------------------------------- arguments


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one to show."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train a nanochat-style byte-level GPT with muon_optax's MuonAdamW.",
        formatter_class=_HelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    run.add_argument("--out", default="runs/gpt", help="output directory")
    run.add_argument("--data", default=None,
                     help="a text file or a directory of text files (default: the Python "
                          "standard library's sources, capped at 8 MiB)")
    run.add_argument("--max-bytes", type=int, default=None,
                     help="read at most this many bytes of the corpus")
    run.add_argument("--seed", type=int, default=0, help="init and data seed")
    run.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")

    model = p.add_argument_group("model and batch")
    model.add_argument("--depth", type=int, default=DEFAULT_DEPTH,
                       help="layers; width = 64 * depth (nanochat's sizing)")
    model.add_argument("--head-dim", type=int, default=64,
                       help="channels per attention head (nanochat uses 128 on GPUs)")
    model.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                       help="global batch size in sequences (split over the devices)")
    model.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per sequence")
    model.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="matmul compute dtype (params stay float32)")

    opt = p.add_argument_group("optimizer (nanochat's defaults)")
    opt.add_argument("--matrix-lr", type=float, default=0.02, help="Muon lr")
    opt.add_argument("--embedding-lr", type=float, default=0.3, help="AdamW lr of wte")
    opt.add_argument("--unembedding-lr", type=float, default=0.008, help="AdamW lr of lm_head")
    opt.add_argument("--scalar-lr", type=float, default=0.5, help="AdamW lr of the scalars")
    opt.add_argument("--weight-decay", type=float, default=0.28, help="Muon weight decay")
    opt.add_argument("--lr-scale", default="1",
                     help="multiplies every MuonAdamW lr: a number, or 'nanochat' for nanochat's "
                          "batch rule sqrt(tokens_per_step / 2**19)")
    opt.add_argument("--warmup-steps", type=int, default=None,
                     help="lr warmup steps (default: min(40, steps // 10))")
    opt.add_argument("--warmdown-frac", type=float, default=0.65,
                     help="final fraction of the run with a linear lr decay")
    opt.add_argument("--final-lr-frac", type=float, default=0.05,
                     help="lr multiplier at the end of the warmdown")
    opt.add_argument("--compare", choices=("adamw",), default=None,
                     help="also train the same model (same init, same data) with optax.adamw")
    opt.add_argument("--adamw-lr", type=float, default=DEFAULT_ADAMW_LR,
                     help="peak lr of the --compare adamw run")

    ev = p.add_argument_group("evaluation and checkpoints")
    ev.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY,
                    help="validate every K steps (and at the start and the end; 0: only then)")
    ev.add_argument("--eval-batches", type=int, default=DEFAULT_EVAL_BATCHES,
                    help="validation batches per evaluation (fixed windows of the held-out tail)")
    ev.add_argument("--ckpt-every", type=int, default=200,
                    help="checkpoint every K steps (and at the end; 0: only at the end)")
    ev.add_argument("--keep-ckpts", type=int, default=2, help="checkpoints kept")
    ev.add_argument("--resume", action="store_true",
                    help="continue from the latest checkpoint under --out (if there is one)")

    dev = p.add_argument_group("devices")
    dev.add_argument("--devices", type=int, default=1,
                     help="data-parallel devices (on CPU simulated; with --distributed: "
                          "simulated CPU devices per process, else ignored)")
    dev.add_argument("--distributed", action="store_true",
                     help="multi-host: jax.distributed.initialize() and a mesh over all devices "
                          "of all processes")
    dev.add_argument("--coordinator", default=None,
                     help="with --distributed: host:port of process 0 (default: auto-detect)")
    dev.add_argument("--num-processes", type=int, default=None,
                     help="with --distributed: process count (default: auto-detect)")
    dev.add_argument("--process-id", type=int, default=None,
                     help="with --distributed: this process's index (default: auto-detect)")
    return p


def _check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "depth", "head_dim", "batch_size", "seq_len", "devices", "eval_batches",
                 "keep_ckpts"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("eval_every", "ckpt_every"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise UsageError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.lr_scale != "nanochat":
        try:
            if not float(args.lr_scale) > 0:
                raise ValueError
        except ValueError:
            raise UsageError(f"--lr-scale must be a positive number or 'nanochat', "
                             f"got {args.lr_scale!r}") from None
    if not 0.0 <= args.warmdown_frac <= 1.0:
        raise UsageError(f"--warmdown-frac must be in [0, 1], got {args.warmdown_frac}")
    if not args.distributed and args.batch_size % args.devices:
        raise UsageError(
            f"--batch-size {args.batch_size} is not divisible by --devices {args.devices}: "
            f"the global batch is split evenly, {args.batch_size} / {args.devices} rows each")
    if not args.distributed and (args.coordinator or args.num_processes is not None
                                 or args.process_id is not None):
        raise UsageError("--coordinator / --num-processes / --process-id need --distributed")


def _simulate_cpu_devices(n: int) -> None:
    """Asks XLA for ``n`` host (CPU) devices; effective only before jax is imported."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    current = [f for f in flags if f.startswith(_DEVICE_FLAG + "=")]
    if current and int(current[-1].split("=", 1)[1]) >= n:
        return
    flags = [f for f in flags if not f.startswith(_DEVICE_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_FLAG}={n}"])


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0, 2 for usage errors, 130 on Ctrl-C)."""
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        try:
            # numpy only: bad paths and small corpora fail before jax is even imported
            dataset = ByteDataset.from_path(args.data, batch_size=args.batch_size,
                                            seq_len=args.seq_len, max_bytes=args.max_bytes,
                                            seed=args.seed)
        except (OSError, ValueError) as e:
            raise UsageError(str(e)) from None
        if args.devices > 1 and "jax" not in sys.modules:
            _simulate_cpu_devices(args.devices)
        return _train_all(args, dataset)
    except UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted (no checkpoint written)", file=sys.stderr)
        return EXIT_INTERRUPTED


# ----------------------------------------------------------------------------- setup


@dataclasses.dataclass
class Context:
    """What both optimizers' runs share: devices, model structure, data, settings."""

    args: argparse.Namespace
    dataset: ByteDataset
    cfg: object              # model.GPTConfig
    graphdef: object         # nnx.GraphDef of the model
    rest: object             # non-Param model state (none in this GPT), passed in read-only
    mesh: object | None      # jax.sharding.Mesh over the "data" axis, None on one device
    num_devices: int
    is_main: bool            # process 0: writes logs, plots, prints
    warmup_steps: int
    dtype: object


def _train_all(args: argparse.Namespace, dataset: ByteDataset) -> int:
    import jax
    import jax.numpy as jnp

    if args.distributed:
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes, process_id=args.process_id)
    from flax import nnx
    from jax.sharding import AxisType
    from model import GPT, GPTConfig

    if args.distributed:
        devices = jax.devices()
    else:
        if args.devices > jax.device_count():
            raise UsageError(
                f"--devices {args.devices}, but jax sees {jax.device_count()} "
                f"{jax.default_backend()} device(s). On CPU run train.py as a script (it sets "
                f"{_DEVICE_FLAG} before importing jax) or set XLA_FLAGS yourself.")
        devices = jax.devices()[: args.devices]
    n = len(devices)
    if args.batch_size % n:
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by the {n} devices")
    mesh = None
    if args.distributed or n > 1:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=devices)

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    try:
        cfg = GPTConfig.from_depth(args.depth, vocab_size=VOCAB_SIZE, seq_len=args.seq_len,
                                   head_dim=args.head_dim)
    except ValueError as e:
        raise UsageError(str(e)) from None
    graphdef, params, rest = nnx.split(GPT(cfg, rngs=nnx.Rngs(args.seed), dtype=dtype),
                                       nnx.Param, ...)
    warmup = args.warmup_steps
    if warmup is None:
        warmup = min(40, max(1, args.steps // 10))
    ctx = Context(args, dataset, cfg, graphdef, rest, mesh, n, jax.process_index() == 0,
                  warmup, dtype)

    out = Path(args.out)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        where = (f"{n} {devices[0].platform} device(s), "
                 + (f"{jax.process_count()} process(es), " if args.distributed else "")
                 + ("data-parallel mesh, sharded MuonAdamW (ZeRO-2)" if mesh is not None
                    else "single device"))
        print(f"model: depth {cfg.n_layer}, width {cfg.n_embd}, {cfg.n_head} heads, "
              f"{_count_params(params):,} params, {args.dtype} compute")
        print(f"data:  {dataset!r}")
        print(f"run:   {args.steps} steps of {args.batch_size} x {args.seq_len} tokens on {where}")

    runs = [("muon", out)]
    if args.compare == "adamw":
        runs.append(("adamw", out / "adamw"))
    results = {}
    t_start = time.perf_counter()
    for name, run_dir in runs:
        result = _train_one(ctx, name, run_dir)
        results[name] = result
        if result["interrupted"]:
            break
    elapsed = time.perf_counter() - t_start

    if ctx.is_main:
        (out / "config.json").write_text(json.dumps(vars(args), indent=2) + "\n")
        png = out / "loss.png"
        _plot([(name, _read_log(run_dir / "log.jsonl")) for name, run_dir in runs
               if (run_dir / "log.jsonl").exists()], png, ctx)
        _summary(results, runs, png, elapsed, ctx)
    if any(r["interrupted"] for r in results.values()):
        return EXIT_INTERRUPTED
    if any(r["diverged"] for r in results.values()):
        return 1
    return 0


def _count_params(params) -> int:
    import jax

    return sum(x.size for x in jax.tree.leaves(params))


def _config_key(ctx: Context, name: str) -> dict:
    """The settings a checkpoint must share with the run that resumes it."""
    a = ctx.args
    key = {k: getattr(a, k) for k in (
        "steps", "seed", "depth", "head_dim", "batch_size", "seq_len", "dtype", "max_bytes",
        "warmdown_frac", "final_lr_frac")}
    key.update(data=str(Path(a.data).resolve()) if a.data else None,
               devices=ctx.num_devices, warmup_steps=ctx.warmup_steps, optimizer=name)
    if name == "muon":
        key.update({k: getattr(a, k) for k in (
            "matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay",
            "lr_scale")})
    else:
        key.update(adamw_lr=a.adamw_lr)
    return key


def _make_tx(ctx: Context, name: str, params):
    """(transformation, sharded): nanochat's MuonAdamW, or the optax.adamw baseline."""
    import jax
    import optax
    from optim_setup import lr_multiplier, make_optimizer, nanochat_batch_lr_scale, param_labels

    a = ctx.args
    if name == "muon":
        lr_scale = (nanochat_batch_lr_scale(a.batch_size * a.seq_len) if a.lr_scale == "nanochat"
                    else float(a.lr_scale))
        tx = make_optimizer(
            params, ctx.cfg, total_steps=a.steps, warmup_steps=ctx.warmup_steps, lr_scale=lr_scale,
            warmdown_frac=a.warmdown_frac, final_lr_frac=a.final_lr_frac,
            embedding_lr=a.embedding_lr, unembedding_lr=a.unembedding_lr,
            matrix_lr=a.matrix_lr, scalar_lr=a.scalar_lr, weight_decay=a.weight_decay,
            axis_name="data" if ctx.mesh is not None else None)
        return tx, ctx.mesh is not None
    # AdamW baseline: GPT-style betas, decoupled weight decay 0.1 on the block matrices only,
    # the same warmup / warmdown shape as MuonAdamW's lr multiplier.
    mult = lr_multiplier(a.steps, ctx.warmup_steps, a.warmdown_frac, a.final_lr_frac)
    mask = jax.tree.map(lambda label: label == "matrix", param_labels(params))
    tx = optax.adamw(lambda step: a.adamw_lr * mult(step), b1=0.9, b2=0.95, eps=1e-8,
                     weight_decay=0.1, mask=mask)
    return tx, False


# ----------------------------------------------------------------------------- steps


def local_value_and_grad(loss_of, params, x, y, axis_name: str | None = None):
    """``(loss, grads)`` of this device's rows ``x, y``; the loss averaged over the devices.

    Inside ``jax.shard_map`` the params come in replicated (``P()``), invariant along
    ``axis_name``, and ``jax.grad`` at an invariant input returns the gradient already
    *summed* over the devices: the transpose of handing one value to every device is a
    ``psum``, an all-reduce of every gradient in the backward pass. ``pcast(...,
    to="varying")`` makes each device's copy its own first, so each device gets the
    gradient of its own rows and the reduction is left to the optimizer (ZeRO-2: one
    reduce-scatter, mean). Every device has as many rows, so the mean of the devices'
    losses is the mean over the global batch.
    """
    import jax

    if axis_name is None:
        return jax.value_and_grad(loss_of)(params, x, y)
    local = jax.lax.pcast(params, axis_name, to="varying")
    loss, grads = jax.value_and_grad(loss_of)(local, x, y)
    return jax.lax.pmean(loss, axis_name), grads


def _build_steps(ctx: Context, tx, sharded_tx: bool, params):
    """Compiled ``init``, ``train_step`` and ``eval_step``, and the state's PartitionSpecs.

    One device: plain ``jax.jit``. A mesh: ``jax.shard_map`` over ``"data"``; the params
    are replicated (``P()``), the batch split by rows (``P("data")``). The sharded
    MuonAdamW takes each device's own, unreduced gradients (``local_value_and_grad``; it
    reduce-scatters them itself); a plain optax transformation gets them ``pmean``'ed and a
    replicated state.
    """
    import jax
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from model import loss_fn

    import muon_optax

    graphdef, rest, mesh = ctx.graphdef, ctx.rest, ctx.mesh

    def loss_of(p, x, y):
        return loss_fn(nnx.merge(graphdef, p, rest), x, y)

    axis = None if mesh is None else "data"

    def train_step(p, state, x, y):
        loss, grads = local_value_and_grad(loss_of, p, x, y, axis)
        if axis is not None and not sharded_tx:
            grads = jax.lax.pmean(grads, axis)  # a replicated optimizer: DDP's all-reduce
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    def eval_step(p, x, y):
        loss = loss_of(p, x, y)
        return jax.lax.pmean(loss, "data") if mesh is not None else loss

    if mesh is None:
        return (jax.jit(tx.init), jax.jit(train_step, donate_argnums=(0, 1)),
                jax.jit(eval_step), None)
    if sharded_tx:
        specs = muon_optax.state_specs(tx, params, mesh)
    else:
        specs = jax.tree.map(lambda _: P(), jax.eval_shape(tx.init, params))
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    train = jax.jit(
        jax.shard_map(train_step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                      out_specs=(P(), specs, P())),
        donate_argnums=(0, 1))
    evaluate = jax.jit(jax.shard_map(eval_step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                     out_specs=P()))
    return init, train, evaluate, specs


class Placement:
    """Puts host arrays onto the devices: replicated params, row-split batches.

    Each process hands over only its own rows of a batch
    (``jax.make_array_from_process_local_data``): with one process that is the whole batch,
    with ``--distributed`` the rows of its devices.
    """

    def __init__(self, mesh):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.mesh = mesh
        if mesh is None:
            device = jax.devices()[0]
            self.replicated = self.rows = jax.sharding.SingleDeviceSharding(device)
        else:
            self.replicated = NamedSharding(mesh, P())
            self.rows = NamedSharding(mesh, P("data"))

    def sharding(self, spec):
        from jax.sharding import NamedSharding

        return self.replicated if self.mesh is None else NamedSharding(self.mesh, spec)

    def params(self, tree):
        import jax
        import numpy as np

        if self.mesh is None:
            return jax.device_put(tree, self.replicated)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.replicated, np.asarray(x)),
            tree)

    def batch(self, x):
        import jax

        if self.mesh is None:
            return jax.device_put(x, self.rows)
        index = self.rows.addressable_devices_indices_map(x.shape).values()
        lo = min(i[0].start or 0 for i in index)
        hi = max(x.shape[0] if i[0].stop is None else i[0].stop for i in index)
        return jax.make_array_from_process_local_data(self.rows, x[lo:hi], x.shape)


def _scalar(x) -> float:
    """A replicated scalar as a Python float (also when other processes hold copies)."""
    import numpy as np

    return float(np.asarray(x.addressable_data(0)))


# ----------------------------------------------------------------------------- checkpoints


class Checkpoints:
    """orbax: ``ckpt/<step>/{params,opt_state,meta}``; restores into the live shardings."""

    def __init__(self, directory: Path, keep: int, fresh: bool, is_main: bool):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        directory = directory.resolve()
        if fresh and directory.exists() and is_main:
            print(f"starting afresh: removing the old checkpoints in {directory} "
                  f"(pass --resume to continue them)")
            shutil.rmtree(directory)
        import jax

        if jax.process_count() > 1:  # nobody opens the directory before process 0 cleared it
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("train.py: checkpoint directory ready")
        self.manager = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
        self.directory = directory

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        ocp = self.ocp
        if self.manager.latest_step() == step:
            return
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))

    def meta(self, step: int) -> dict:
        ocp = self.ocp
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"]

    def restore(self, step: int, abstract_params, abstract_state):
        ocp = self.ocp
        r = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params),
            opt_state=ocp.args.StandardRestore(abstract_state)))
        return r["params"], r["opt_state"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class StopRequest:
    """Ctrl-C (SIGINT) sets a flag checked after each step; a second Ctrl-C aborts at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


# ----------------------------------------------------------------------------- training


def _read_log(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _train_one(ctx: Context, name: str, run_dir: Path) -> dict:
    """Trains one optimizer from the shared init; resumes from ``run_dir/ckpt`` if asked."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from model import GPT
    from optim_setup import lr_multiplier
    from tqdm.auto import tqdm

    a, ds = ctx.args, ctx.dataset
    place = Placement(ctx.mesh)
    # Same seed, same init for every optimizer.
    _, params, _ = nnx.split(GPT(ctx.cfg, rngs=nnx.Rngs(a.seed), dtype=ctx.dtype), nnx.Param, ...)
    tx, sharded_tx = _make_tx(ctx, name, params)

    run_dir.mkdir(parents=True, exist_ok=True)
    ckpts = Checkpoints(run_dir / "ckpt", a.keep_ckpts, fresh=not a.resume, is_main=ctx.is_main)
    key = _config_key(ctx, name)
    start = 0
    if a.resume and ckpts.latest() is not None:
        start = ckpts.latest()
        saved = ckpts.meta(start)
        diff = {k: (saved["config"][k], v) for k, v in key.items()
                if k in saved["config"] and saved["config"][k] != v}
        if diff:
            ckpts.close()
            raise UsageError(
                f"--resume: the checkpoint in {ckpts.directory} was written with other settings: "
                + ", ".join(f"{k}={old!r} (now {new!r})" for k, (old, new) in diff.items()))

    init, train_step, eval_step, specs = _build_steps(ctx, tx, sharded_tx, params)
    if start == 0:
        params = place.params(params)
        opt_state = init(params)
    else:
        # The restore target: abstract arrays with the shardings the step expects (the
        # optimizer state's from its PartitionSpecs), so orbax puts every shard in place.
        def target(x, spec=P()):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place.sharding(spec))

        abstract_state = jax.eval_shape(init, params)
        abstract_state = (jax.tree.map(target, abstract_state) if specs is None
                          else jax.tree.map(target, abstract_state, specs))
        try:
            params, opt_state = ckpts.restore(start, jax.tree.map(target, params),
                                              abstract_state)
        except ValueError as e:  # e.g. written by a version with another state layout
            ckpts.close()
            raise UsageError(f"--resume: cannot restore {ckpts.directory / str(start)}: {e}")
        if ctx.is_main:
            print(f"[{name}] resumed from {ckpts.directory / str(start)} (step {start})")

    log_path = run_dir / "log.jsonl"
    records = []
    if start > 0 and log_path.exists():
        records = [r for r in _read_log(log_path) if r["step"] <= start]
    log = open(log_path, "w") if ctx.is_main else None

    def write(record):
        records.append(record)
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()

    if log is not None:
        log.writelines(json.dumps(r) + "\n" for r in records)

    def evaluate(p) -> dict:
        res = ds.evaluate(lambda x, y: _scalar(eval_step(p, place.batch(x), place.batch(y))),
                          max_batches=a.eval_batches)
        return {"val_loss": res["loss"], "val_bpb": res["bpb"]}

    lr_mults = np.asarray(jax.jit(jax.vmap(lr_multiplier(
        a.steps, ctx.warmup_steps, a.warmdown_frac, a.final_lr_frac)))(np.arange(a.steps)))
    tokens = a.batch_size * a.seq_len

    def meta(step):
        return {"step": step, "data_position": step, "config": key}

    result = {"interrupted": False, "diverged": False, "start": start, "end": start,
              "compile_s": 0.0, "train_s": 0.0}

    if start == 0:
        write({"step": 0, **evaluate(params)})
    if start >= a.steps:
        if ctx.is_main:
            print(f"[{name}] already trained for {start} steps; nothing to do")
    else:
        x0, y0 = ds.batch(start)
        t0 = time.perf_counter()
        train_step = train_step.lower(params, opt_state, place.batch(x0),
                                      place.batch(y0)).compile()
        result["compile_s"] = time.perf_counter() - t0
        if ctx.is_main:
            print(f"[{name}] train step compiled in {result['compile_s']:.1f} s")
        bar = tqdm(total=a.steps, initial=start, desc=name, unit="step", dynamic_ncols=True,
                   disable=a.no_progress or not ctx.is_main)
        saved_at = None
        with StopRequest() as stop:
            for step in range(start, a.steps):
                t0 = time.perf_counter()
                x, y = ds.batch(step)
                params, opt_state, loss = train_step(params, opt_state, place.batch(x),
                                                     place.batch(y))
                loss = _scalar(loss)
                dt = time.perf_counter() - t0
                result["train_s"] += dt
                done = step + 1
                record = {"step": done, "loss": loss, "lr_mult": float(lr_mults[step]),
                          "tokens_per_s": tokens / dt}
                if not math.isfinite(loss):
                    write(record)
                    bar.close()
                    print(f"[{name}] the loss is {loss} at step {done}: training diverged "
                          f"(lower the learning rates)", file=sys.stderr)
                    result.update(diverged=True, end=done)
                    break
                if done == a.steps or (a.eval_every and done % a.eval_every == 0):
                    record.update(evaluate(params))
                    if ctx.is_main:
                        bar.write(f"[{name}] step {done}: val loss {record['val_loss']:.4f} "
                                  f"(bpb {record['val_bpb']:.3f})")
                write(record)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / dt:,.0f}",
                                lr=f"{record['lr_mult']:.2f}", refresh=False)
                result["end"] = done
                if done == a.steps or (a.ckpt_every and done % a.ckpt_every == 0):
                    ckpts.save(done, params, opt_state, meta(done))
                    saved_at = done
                if stop.requested:
                    break
        bar.close()
        if stop.requested:
            if saved_at != result["end"]:
                ckpts.save(result["end"], params, opt_state, meta(result["end"]))
            result["interrupted"] = True
            if ctx.is_main:
                print(f"\n[{name}] interrupted: checkpoint of step {result['end']} saved in "
                      f"{ckpts.directory}; continue with the same command and --resume",
                      file=sys.stderr)
    ckpts.close()
    if log is not None:
        log.close()
    result["records"] = records
    result["ckpt_dir"] = ckpts.directory
    result["log"] = log_path
    return result


# ----------------------------------------------------------------------------- reporting


def _plot(runs: list[tuple[str, list[dict]]], path: Path, ctx: Context) -> None:
    """Train loss (raw, faint, and an EMA) and validation loss against steps, per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"muon": "tab:blue", "adamw": "tab:orange"}
    labels = {"muon": "MuonAdamW (muon_optax)", "adamw": f"AdamW (optax, lr {ctx.args.adamw_lr:g})"}
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    lows, highs = [], []
    for name, records in runs:
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        c = colors.get(name, None)
        if train:
            steps, losses = zip(*train)
            ema, smooth = None, []
            for v in losses:
                ema = v if ema is None else 0.9 * ema + 0.1 * v
                smooth.append(ema)
            ax.plot(steps, losses, color=c, alpha=0.2, lw=0.7)
            ax.plot(steps, smooth, color=c, lw=1.4, label=f"{labels.get(name, name)}: train")
            lows.append(min(smooth))
        if val:
            steps, losses = zip(*val)
            ax.plot(steps, losses, color=c, ls="--", marker="o", ms=4, lw=1.2,
                    label=f"{labels.get(name, name)}: val ({losses[-1]:.3f})")
            lows.append(min(losses))
            highs.append(losses[min(1, len(losses) - 1)])
    if lows:
        lo = min(lows)
        hi = max(highs + [lo + 0.5])
        ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.3 * (hi - lo))
    a = ctx.args
    ax.set_title(f"GPT depth {a.depth}, batch {a.batch_size} x {a.seq_len} bytes, "
                 f"{ctx.num_devices} device{'s' if ctx.num_devices > 1 else ''}", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    # A 64-colour palette: the same picture at about a third of the bytes.
    from PIL import Image

    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(colors=64).save(path, optimize=True)


def _summary(results: dict, runs, png: Path, elapsed: float, ctx: Context) -> None:
    print()
    print(f"finished in {elapsed:.0f} s")
    for name, run_dir in runs:
        if name not in results:
            continue
        r = results[name]
        val = [x for x in r["records"] if "val_loss" in x]
        steps = r["end"] - r["start"]
        speed = (steps * ctx.args.batch_size * ctx.args.seq_len / r["train_s"]
                 if r["train_s"] else 0.0)
        line = f"  {name:>5}: {r['end']} steps"
        if steps:
            line += (f" ({steps} this run: {r['train_s']:.1f} s of steps, {speed:,.0f} tokens/s,"
                     f" compile {r['compile_s']:.1f} s)")
        print(line)
        if val:
            first, last = val[0], val[-1]
            print(f"         val loss {first['val_loss']:.4f} (step {first['step']}) -> "
                  f"{last['val_loss']:.4f} (step {last['step']}); bits per byte "
                  f"{bits_per_byte(first['val_loss']):.3f} -> {last['val_bpb']:.3f}")
        print(f"         log {r['log']}, checkpoints {r['ckpt_dir']}")
    print(f"  plot: {png}")


if __name__ == "__main__":
    sys.exit(main())
