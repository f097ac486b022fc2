"""Train a nanochat-style GPT (Flax NNX) with muon_optax's MuonAdamW, on one device or a mesh.

    python examples/gpt/train.py                       # the default run: ~4 min on 2 CPU cores
    python examples/gpt/train.py --compare adamw       # + the same model with optax.adamw
    python examples/gpt/train.py --devices 4           # data-parallel, ZeRO-2 optimizer
    python examples/gpt/train.py --devices 4 --fsdp    # params, grads and state sharded
    python examples/gpt/train.py --resume              # continue from the last checkpoint
    python examples/gpt/train.py --data my_texts/ --depth 6 --steps 2000
    python examples/gpt/train.py --aot v5p:2x2x2 --depth 12  # fits a TPU slice? (aot.py)

Everything lands under ``--out`` (default ``runs/gpt``):

    config.json        the settings as resolved (warmup steps, lr scale, learning rates),
                       written at the start and updated at the end with the run's status
    log.jsonl          one strict-JSON record per step: step, loss, lr, lr_mult,
                       tokens_per_s, and val_loss / val_bpb at every evaluation (step 0
                       holds only the validation numbers of the untrained model)
    loss.png           the loss curves (train and validation; both optimizers with --compare)
    ckpt/<step>/       orbax checkpoints: params, optimizer state (portable: any device
                       count, any mode), step (= data position)
    adamw/             with --compare adamw: the AdamW run's log.jsonl and ckpt/
    .lock.<id>         the lock process <id> holds while it runs: a second run on the same
                       --out is refused (outlock.py); --distributed processes check at the
                       start that they agree on the run's settings, data and code (agree.py)

The data is a pure function of the step (``ByteDataset.batch(step)``), so a checkpoint
needs only the step to continue the data stream, and ``--resume`` reproduces the loss
sequence of an uninterrupted run. SIGINT (Ctrl-C) or SIGTERM on any process stops every
process after the same step with a checkpoint (status 130, or 143 for SIGTERM); a second
signal aborts at once (see ``stopping.py``).

``--devices N`` (N > 1) trains data-parallel on an N-device mesh: the train step runs
inside ``jax.shard_map``, each device computes the gradients of its ``batch_size / N``
rows, and ``muon_optax``'s sharded MuonAdamW (ZeRO-2) reduce-scatters them, updates the
share of the state each device owns and all-gathers the updates. On CPU the N devices are
simulated (``XLA_FLAGS=--xla_force_host_platform_device_count``, set here before jax is
imported). ``--fsdp`` shards the params, gradients and optimizer state over the devices
instead and runs the train step under plain ``jax.jit`` (see ``parallel.py``).
``--distributed`` runs the same step over every device of every process
(``jax.distributed.initialize()``; one process per host). A checkpoint written in one
of these modes resumes in any other (``checkpoints.py``).

``main(argv)`` runs in-process too (the tests do); jax is imported only after the
arguments are checked, so that the simulated device count can still be set and bad
input fails in a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.util
import math
import os
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # model.py, data.py, optim_setup.py sit beside this file
    sys.path.insert(0, str(HERE))
if importlib.util.find_spec("muon_optax") is None:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parents[1]))

# numpy and the standard library only: no jax before the arguments are checked
from checkpoints import CheckpointError  # noqa: E402
from data import DEFAULT_MAX_BYTES, VOCAB_SIZE, ByteDataset  # noqa: E402
from report import LogWriteError  # noqa: E402
from stopping import EXIT_SIGINT, EXIT_SIGTERM, SIGNAL_NAMES, StopSignals  # noqa: E402

# The default run: ~4 minutes on 2 idle CPU cores (see the notes in the README section).
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

EXIT_DIVERGED = 1
EXIT_FAILED = 1  # a checkpoint could not be written, a process was lost
EXIT_USAGE = 2
EXIT_INTERRUPTED = EXIT_SIGINT
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


class UsageError(Exception):
    """A problem with the command line or the data: reported as one line, exit status 2."""


class RunFailed(Exception):
    """A run that cannot go on (a lost process): reported as one line, exit status 1."""


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
    _run_flags(p.add_argument_group("run"))
    _model_flags(p.add_argument_group("model and batch"))
    _optimizer_flags(p.add_argument_group("optimizer (nanochat's defaults)"))
    _eval_flags(p.add_argument_group("evaluation and checkpoints"))
    _device_flags(p.add_argument_group("devices"))
    return p


def _run_flags(run) -> None:
    run.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    run.add_argument("--out", default="runs/gpt", help="output directory")
    run.add_argument("--data", default=None,
                     help="a text file or a directory of text files (default: the Python "
                          "standard library's sources, capped at 8 MiB)")
    run.add_argument("--max-bytes", type=int, default=None,
                     help="read at most this many bytes of the corpus")
    run.add_argument("--seed", type=int, default=0, help="init and data seed")
    run.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def _model_flags(model) -> None:
    model.add_argument("--depth", type=int, default=DEFAULT_DEPTH,
                       help="layers; width = 64 * depth (nanochat's sizing)")
    model.add_argument("--head-dim", type=int, default=64,
                       help="channels per attention head, even (nanochat uses 128 on GPUs)")
    model.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                       help="global batch size in sequences (split over the devices)")
    model.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per sequence")
    model.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="matmul compute dtype (params stay float32)")


def _optimizer_flags(opt) -> None:
    opt.add_argument("--matrix-lr", type=float, default=0.02, help="Muon lr")
    opt.add_argument("--embedding-lr", type=float, default=0.3, help="AdamW lr of wte")
    opt.add_argument("--unembedding-lr", type=float, default=0.008, help="AdamW lr of lm_head")
    opt.add_argument("--scalar-lr", type=float, default=0.5, help="AdamW lr of the scalars")
    opt.add_argument("--weight-decay", type=float, default=0.28, help="Muon weight decay")
    opt.add_argument("--lr-scale", default="1",
                     help="multiplies every MuonAdamW lr: a number, or 'nanochat' for nanochat's "
                          "batch rule sqrt(tokens_per_step / 2**19)")
    opt.add_argument("--warmup-steps", type=int, default=None,
                     help="lr warmup steps, at most --steps (default: min(40, steps // 10))")
    opt.add_argument("--warmdown-frac", type=float, default=0.65,
                     help="final fraction of the run with a linear lr decay, in [0, 1]")
    opt.add_argument("--final-lr-frac", type=float, default=0.05,
                     help="lr multiplier at the end of the warmdown, in [0, 1]")
    opt.add_argument("--muon-blocks", default="none",
                     help="Muon on blocks of the attention kernels: none (nanochat's rule, "
                          "each kernel one matrix), heads (each head's block its own "
                          "matrix), or groups:G (G heads per block, Group Muon)")
    opt.add_argument("--compare", choices=("adamw",), default=None,
                     help="also train the same model (same init, same data) with optax.adamw")
    opt.add_argument("--adamw-lr", type=float, default=DEFAULT_ADAMW_LR,
                     help="peak lr of the --compare adamw run")


def _eval_flags(ev) -> None:
    ev.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY,
                    help="validate every K steps (and at the start and the end; 0: only then)")
    ev.add_argument("--eval-batches", type=int, default=DEFAULT_EVAL_BATCHES,
                    help="validation batches per evaluation (fixed windows of the held-out tail)")
    ev.add_argument("--ckpt-every", type=int, default=200,
                    help="checkpoint every K steps (and at the end; 0: only at the end)")
    ev.add_argument("--keep-ckpts", type=int, default=2, help="checkpoints kept")
    ev.add_argument("--resume", action="store_true",
                    help="continue from the latest checkpoint under --out (with none there, "
                         "say so and start afresh)")


def _device_flags(dev) -> None:
    dev.add_argument("--devices", type=int, default=1,
                     help="data-parallel devices (on CPU simulated; with --distributed: "
                          "simulated CPU devices per process, else ignored)")
    dev.add_argument("--fsdp", action="store_true",
                     help="fully sharded data parallel: params, gradients and optimizer state "
                          "split over the devices (default: ZeRO-2, params replicated)")
    dev.add_argument("--distributed", action="store_true",
                     help="multi-host: jax.distributed.initialize() and a mesh over all devices "
                          "of all processes")
    dev.add_argument("--coordinator", default=None,
                     help="with --distributed: host:port of process 0 (default: auto-detect)")
    dev.add_argument("--num-processes", type=int, default=None,
                     help="with --distributed: process count (default: auto-detect)")
    dev.add_argument("--process-id", type=int, default=None,
                     help="with --distributed: this process's index (default: auto-detect)")
    dev.add_argument("--init-timeout", type=int, default=300,
                     help="with --distributed: seconds to wait at the start for every process "
                          "to join; then one line and exit 2")
    dev.add_argument("--aot", default=None, metavar="TOPOLOGY",
                     help="dry run for a TPU slice (e.g. v5p:2x2x2, v5e:2x4, v5p:1 for one "
                          "chip): compile the whole train step for it without a TPU, print "
                          "memory per chip and collectives, exit; needs libtpu (aot.py)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_AT_LEAST_ONE = ("steps", "depth", "head_dim", "batch_size", "seq_len", "devices",
                 "eval_batches", "keep_ckpts", "init_timeout")
_AT_LEAST_ZERO = ("eval_every", "ckpt_every")
_LEARNING_RATES = ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "adamw_lr")
_FRACTIONS = ("warmdown_frac", "final_lr_frac")
MAX_STEPS = 2**31 - 1    # optax counts steps in int32
MAX_SEED = 2**63 - 1     # jax.random.key takes an int64
FLOAT32_MAX = 3.4028234663852886e38
REFERENCE_D_MODEL = 768  # optim_setup's: the AdamW lrs scale by (width / 768) ** -0.5


def _check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag in its range (see the flags' help)."""
    for name in _AT_LEAST_ONE:
        if getattr(args, name) < 1:
            raise UsageError(f"{_flag(name)} must be >= 1, got {getattr(args, name)}")
    for name in _AT_LEAST_ZERO:
        if getattr(args, name) < 0:
            raise UsageError(f"{_flag(name)} must be >= 0, got {getattr(args, name)}")
    if args.steps > MAX_STEPS:
        raise UsageError(f"--steps must be <= {MAX_STEPS:,} (optax counts steps in int32), "
                         f"got {args.steps:,}")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be in [0, 2**63 - 1], got {args.seed}")
    if args.head_dim % 2:
        raise UsageError(f"--head-dim must be even (rotary embeddings turn channel pairs), "
                         f"got {args.head_dim}")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise UsageError(f"--max-bytes must be >= 1, got {args.max_bytes}")
    if args.warmup_steps is not None and not 0 <= args.warmup_steps <= args.steps:
        raise UsageError(f"--warmup-steps must be in [0, --steps = {args.steps}], got "
                         f"{args.warmup_steps}: the warmup would outlast the run")
    for name in _LEARNING_RATES:
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{_flag(name)} must be a positive number, got {value}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise UsageError(f"--weight-decay must be >= 0, got {args.weight_decay}")
    for name in _FRACTIONS:
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise UsageError(f"{_flag(name)} must be in [0, 1], got {getattr(args, name)}")
    if args.lr_scale != "nanochat":
        try:
            if not (math.isfinite(float(args.lr_scale)) and float(args.lr_scale) > 0):
                raise ValueError
        except ValueError:
            raise UsageError(f"--lr-scale must be a positive number or 'nanochat', "
                             f"got {args.lr_scale!r}") from None


def model_width(depth: int, head_dim: int) -> int:
    """``GPTConfig.from_depth``'s width: 64 per layer, rounded up to whole heads."""
    return -(-64 * depth // head_dim) * head_dim


def param_count(depth: int, head_dim: int) -> int:
    """The GPT's parameter count from its config alone: embedding and unembedding
    (256 x width each), per layer four width^2 attention and two 4 width^2 MLP matrices
    and two scalars."""
    d = model_width(depth, head_dim)
    return 2 * VOCAB_SIZE * d + depth * (12 * d * d + 2)


def _check_learning_rates(args: argparse.Namespace) -> None:
    """The learning rates as the optimizer will use them (times --lr-scale, the AdamW
    ones times nanochat's width factor) must be finite in float32, and so must their
    product with the weight decay."""
    scale = (math.sqrt(args.batch_size * args.seq_len / 2**19) if args.lr_scale == "nanochat"
             else float(args.lr_scale))
    width_factor = max(1.0, (model_width(args.depth, args.head_dim) / REFERENCE_D_MODEL) ** -0.5)
    for name in _LEARNING_RATES:
        lr = getattr(args, name) * (1.0 if name == "adamw_lr" else scale * width_factor)
        if not lr * max(1.0, args.weight_decay) <= FLOAT32_MAX:
            raise UsageError(f"{_flag(name)} {getattr(args, name)} times --lr-scale "
                             f"{args.lr_scale} (and --weight-decay {args.weight_decay}) "
                             f"overflows float32: lower them")


def _check_devices(args: argparse.Namespace) -> None:
    if not args.distributed and args.batch_size % args.devices:
        raise UsageError(
            f"--batch-size {args.batch_size} is not divisible by --devices {args.devices}: "
            f"the global batch is split evenly, {args.batch_size} / {args.devices} rows each")
    if not args.distributed and (args.coordinator or args.num_processes is not None
                                 or args.process_id is not None):
        raise UsageError("--coordinator / --num-processes / --process-id need --distributed")
    if args.coordinator is not None:
        _check_coordinator(args.coordinator)
    if args.num_processes is not None and args.num_processes < 1:
        raise UsageError(f"--num-processes must be >= 1, got {args.num_processes}")
    if args.process_id is not None and not (
            0 <= args.process_id < (args.num_processes or args.process_id + 1)):
        raise UsageError(f"--process-id must be in [0, --num-processes), got {args.process_id}")


def _check_coordinator(address: str) -> None:
    """``host:port``, the port a number in 1..65535 and the host known to the resolver
    (jax crashes on either, or waits for minutes)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise UsageError(f"--coordinator must be host:port, got {address!r}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"--coordinator {address}: the port must be a number in 1..65535, "
                         f"got {port!r}")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except (OSError, UnicodeError) as e:
        raise UsageError(f"--coordinator {address}: cannot resolve host {host!r} ({e})") from None


def _check_out(args: argparse.Namespace) -> None:
    """``--out`` must be a directory, or a path where one can be made."""
    out = Path(args.out)
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                raise UsageError(f"--out {args.out}: {path} is a file, not a directory")
            break
    for ckpt in (out / "ckpt", out / "adamw" / "ckpt"):
        if ckpt.is_symlink() and not ckpt.exists():
            raise UsageError(f"--out {args.out}: {ckpt} is a symbolic link that leads nowhere "
                             f"(a loop, or its target is gone): remove it, or point it at a "
                             f"directory")
        if args.resume and ckpt.exists() and not ckpt.is_dir():
            raise UsageError(f"--resume: {ckpt} is a file, not a checkpoint directory")


def heads_per_block(args: argparse.Namespace) -> int | None:
    """``--muon-blocks`` as heads per Muon block: none -> None (nanochat's rule), heads
    -> 1, groups:G -> G; a usage error for another spelling or a G that does not divide
    the model's heads."""
    spelling = args.muon_blocks
    if spelling in ("none", "heads"):
        return None if spelling == "none" else 1
    name, _, group = spelling.partition(":")
    if name != "groups" or not group.isdigit() or int(group) < 1:
        raise UsageError(f"--muon-blocks must be none, heads or groups:G (G heads per "
                         f"block, G >= 1), got {spelling!r}")
    heads = model_width(args.depth, args.head_dim) // args.head_dim
    if heads % int(group):
        raise UsageError(f"--muon-blocks {spelling}: {group} heads per block do not divide "
                         f"the model's {heads} heads (--depth {args.depth}, --head-dim "
                         f"{args.head_dim})")
    return int(group)


def _check_args(args: argparse.Namespace) -> None:
    _check_numbers(args)
    heads_per_block(args)
    _check_learning_rates(args)
    _check_devices(args)
    _check_out(args)


def _load_data(args: argparse.Namespace) -> ByteDataset:
    """The corpus, read and split before jax is even imported (bad paths fail at once)."""
    try:
        return ByteDataset.from_path(args.data, batch_size=args.batch_size, seq_len=args.seq_len,
                                     max_bytes=args.max_bytes, seed=args.seed)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    except MemoryError:
        raise UsageError(f"--data {args.data}: out of memory while reading it; read only a "
                         f"part of it with --max-bytes") from None


def _simulate_cpu_devices(n: int) -> None:
    """Asks XLA for ``n`` host (CPU) devices; effective only before jax is imported."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    current = [f for f in flags if f.startswith(_DEVICE_FLAG + "=")]
    if current and int(current[-1].split("=", 1)[1]) >= n:
        return
    flags = [f for f in flags if not f.startswith(_DEVICE_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_FLAG}={n}"])


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status: 0; 1 if training diverged; 2 for
    usage errors (and a model too big for the devices); 130 after SIGINT, 143 after SIGTERM."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        if args.aot:
            from aot import check

            check(args, UsageError)
        dataset = _load_data(args)
        if args.devices > 1 and "jax" not in sys.modules:
            _simulate_cpu_devices(args.devices)
        # --aot runs nothing and leaves --out alone: no lock to hold.
        if not args.aot and (not args.distributed or args.process_id is not None):
            _hold_out(args, argv, args.process_id or 0)  # else once jax knows the id
        return _train_all(args, dataset, argv)
    except UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, LogWriteError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except RunFailed as e:
        # A lost process: jax's shutdown at exit would wait minutes for it. Nothing is
        # left to save (the checkpoints on disk are sealed), so leave at once.
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)
    except KeyboardInterrupt:
        print("\ninterrupted (no checkpoint written)", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        while _HELD:
            _HELD.pop().release()


_HELD: list = []  # this process's outlock.OutLock, released when main returns


def _run_identity(args: argparse.Namespace) -> dict:
    """What the processes of one run share, as the lock files record it."""
    if not args.distributed:
        return {"coordinator": None, "num_processes": 1}
    return {"coordinator": args.coordinator, "num_processes": args.num_processes}


def _hold_out(args: argparse.Namespace, argv: list[str], process_id: int) -> None:
    """Takes this process's lock in ``--out`` (``outlock.py``): a run already there, or
    another process with this ``--process-id``, is refused in one line naming it."""
    from outlock import FolderBusy, OutLock

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot create the directory ({e})") from None
    try:
        _HELD.append(OutLock(out, process_id, _run_identity(args), argv).acquire())
    except FolderBusy as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a file system without locks
            print(f"train.py: warning: --out {args.out} takes no file locks ({e.strerror}): "
                  f"nothing stops a second run from writing there too", file=sys.stderr)
            return
        raise UsageError(f"--out {args.out}: cannot hold a lock file there ({e.strerror})"
                         ) from None


# ----------------------------------------------------------------------------- setup


@dataclasses.dataclass
class Context:
    """What both optimizers' runs share: devices, model structure, data, settings."""

    args: argparse.Namespace
    argv: list[str]
    dataset: ByteDataset
    cfg: object              # model.GPTConfig
    graphdef: object         # nnx.GraphDef of the model
    rest: object             # non-Param model state (none in this GPT), passed in read-only
    abstract_params: object  # the params as jax.ShapeDtypeStructs: nothing allocated
    init_params: object      # jitted () -> params, placed for the mode (parallel.py)
    devices: list
    mesh: object | None      # jax.sharding.Mesh over the "data" axis, None on one device
    place: object            # parallel.Layout: the mode, and where arrays go
    is_main: bool            # process 0: writes logs, plots, prints
    warmup_steps: int
    lr_scale: float
    estimate: object = None  # memory.Estimate

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def runs(self) -> list[tuple[str, Path]]:
        out = Path(self.args.out)
        return [("muon", out)] + ([("adamw", out / "adamw")] if self.args.compare else [])


def _init_distributed(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize``, said before it waits, and bounded by
    ``--init-timeout``: jax's own timeout ends the process with an abort (status 134)
    after its tracebacks, so a watchdog says so in one line first and exits 2."""
    import jax

    # The agreed stop relies on jax's preemption service (on by default): keep it on.
    jax.config.update("jax_enable_preemption_service", True)
    where = f" at {args.coordinator}" if args.coordinator else ""
    print(f"train.py: joining the other processes{where} (waiting up to {args.init_timeout} s, "
          f"--init-timeout)", file=sys.stderr, flush=True)

    watchdog = threading.Thread(target=_watch_join, args=(args, time.time()), daemon=True)
    _JOINED.clear()
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes, process_id=args.process_id,
                                   initialization_timeout=args.init_timeout + 60)
    except (ValueError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"--distributed: jax.distributed.initialize failed ({first}); off a "
                         "cluster it detects (SLURM, Open MPI, Cloud TPU), pass --coordinator "
                         "host:port, --num-processes and --process-id") from None
    finally:
        _JOINED.set()
    _no_cache_where_it_hangs()


_JOINED = threading.Event()  # set once jax.distributed.initialize has returned


def _no_cache_where_it_hangs() -> None:
    """On jaxlib 0.12.1 and later, CPU (gloo): a multi-process program loaded from jax's
    persistent compilation cache hangs in its first collective (0.10.2 and 0.12.0.1 run it).
    Such a run compiles afresh, and says so; before its first compile, which reads the flag."""
    import jax
    import jaxlib

    version = tuple(int(x) for x in jaxlib.__version__.split(".")[:3] if x.isdigit())
    if (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
            and version >= (0, 12, 1) and jax.default_backend() == "cpu"):
        jax.config.update("jax_enable_compilation_cache", False)
        print(f"train.py: jax's persistent compilation cache is off for this run: on jaxlib "
              f"{jaxlib.__version__} a multi-process CPU program loaded from it hangs in its "
              "first collective", file=sys.stderr, flush=True)


def _watch_join(args: argparse.Namespace, since: float) -> None:
    """While ``jax.distributed.initialize`` waits: a duplicate of this run's process ids
    refused meanwhile (``outlock``'s note) ends the wait at once, naming it; after
    ``--init-timeout`` the wait ends naming the ids that no process holds. One line, then
    exit 2 (jax's own timeout aborts with status 134 after its tracebacks)."""
    from outlock import describe, missing_ids, refusals

    out, run = Path(args.out), _run_identity(args)
    while not _JOINED.wait(0.5):
        refused = refusals(out, run) if args.process_id is not None else []
        if refused:
            pid, info = refused[0]
            _give_up(f"--process-id {pid} was given to two processes of this run ({describe(info)}"
                     f" was refused): restart every process with its own --process-id")
        if time.time() - since > args.init_timeout:
            missing = (missing_ids(out, args.num_processes)
                       if args.num_processes and args.process_id is not None else [])
            which = (f": no process holds --process-id {', '.join(map(str, missing))} in "
                     f"{out}" if missing else "")
            _give_up(f"not every process joined within {args.init_timeout} s (--init-timeout)"
                     f"{which}; start every process with the same --coordinator and "
                     f"--num-processes, each with its own --process-id, or check the network")


def _give_up(message: str) -> None:
    if _JOINED.is_set():
        return
    sys.stderr.write(f"train.py: error: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_USAGE)


def _agree(args: argparse.Namespace, dataset: ByteDataset) -> None:
    """Every process checks, once, that all were started with the same settings, data
    and code (``agree.py``); a difference is refused on every process in one line."""
    import agree

    try:
        agree.check(agree.settings(args, dataset.fingerprint, agree.code_fingerprint()))
    except agree.Disagreement as e:
        raise UsageError(str(e)) from None


def _pick_devices(args: argparse.Namespace) -> list:
    import jax

    if args.aot:
        from aot import topology_devices

        devices = topology_devices(args.aot, UsageError)
    elif args.distributed:
        devices = jax.devices()
    elif args.devices > jax.device_count():
        raise UsageError(
            f"--devices {args.devices}, but jax sees {jax.device_count()} "
            f"{jax.default_backend()} device(s). On CPU run train.py as a script (it sets "
            f"{_DEVICE_FLAG} before importing jax) or set XLA_FLAGS yourself.")
    else:
        devices = jax.devices()[: args.devices]
    if args.batch_size % len(devices):
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by the "
                         f"{len(devices)} devices")
    return devices


def _abstract_model(args: argparse.Namespace, dtype):
    """``(cfg, graphdef, abstract params, rest)``: the model's structure, nothing allocated."""
    from flax import nnx
    from model import GPT, GPTConfig

    try:
        cfg = GPTConfig.from_depth(args.depth, vocab_size=VOCAB_SIZE, seq_len=args.seq_len,
                                   head_dim=args.head_dim)
    except ValueError as e:
        raise UsageError(str(e)) from None
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(args.seed), dtype=dtype))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return cfg, graphdef, params, rest


def _param_initializer(cfg, seed: int, dtype, sharding):
    """A jitted ``() -> params``: the seed's init, one compiled program, placed as
    ``sharding`` says (one for all, or a tree). jax's random bits do not depend on the
    sharding, so every mode starts from the same params."""
    import jax
    from flax import nnx
    from model import GPT

    def init():
        return nnx.split(GPT(cfg, rngs=nnx.Rngs(seed), dtype=dtype), nnx.Param, ...)[1]

    return jax.jit(init, out_shardings=sharding)


def _setup(args: argparse.Namespace, dataset: ByteDataset, argv: list[str]) -> Context:
    """Devices, mesh and the model's shapes; prints the plan and checks that it fits."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType

    if args.distributed:  # first: no library import may touch the backend before it
        _init_distributed(args)
        if args.process_id is None:  # detected by jax: the lock comes only now
            _hold_out(args, argv, jax.process_index())
        _agree(args, dataset)
    from optim_setup import nanochat_batch_lr_scale
    from parallel import Layout

    devices = _pick_devices(args)
    mesh = None
    if args.distributed or args.fsdp or len(devices) > 1:
        mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,),
                             devices=devices)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    _check_size(args, devices)
    cfg, graphdef, abstract_params, rest = _abstract_model(args, dtype)
    from optim_setup import block_axes

    blocks = heads_per_block(args)
    place = Layout(mesh, fsdp=args.fsdp,
                   blocks_of=lambda path: block_axes(path, cfg.n_head, blocks))
    warmup = args.warmup_steps
    if warmup is None:
        warmup = min(40, max(1, args.steps // 10))
    lr_scale = (nanochat_batch_lr_scale(args.batch_size * args.seq_len)
                if args.lr_scale == "nanochat" else float(args.lr_scale))
    ctx = Context(args, argv, dataset, cfg, graphdef, rest, abstract_params,
                  _param_initializer(cfg, args.seed, dtype,
                                     place.shardings(place.param_specs(abstract_params))),
                  devices, mesh,
                  place, jax.process_index() == 0, warmup, lr_scale)
    ctx.estimate = _estimate_memory(ctx)
    if ctx.is_main:
        _print_plan(ctx)
    _check_fits(ctx)
    return ctx


def _check_size(args: argparse.Namespace, devices: list) -> None:
    """Refuses, from the config's arithmetic alone (before the model's shapes are traced,
    which takes minutes for a huge one), a model whose float32 params and gradients
    alone exceed a device's memory; ``_check_fits`` checks the whole estimate later."""
    import jax
    import memory

    n = param_count(args.depth, args.head_dim)
    need = 2 * 4 * n // (len(devices) if args.fsdp else 1)
    limit, what = memory.device_memory(devices[0], jax.local_device_count())
    if limit is not None and need > limit:
        raise UsageError(f"the model does not fit: depth {args.depth} and head dim "
                         f"{args.head_dim} make {n:,} params, {memory.fmt(need)} per device "
                         f"for params and gradients alone, but {what}; lower --depth")


def _count_params(params) -> int:
    import jax

    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def _print_plan(ctx: Context) -> None:
    import jax

    a, cfg, n = ctx.args, ctx.cfg, ctx.num_devices
    mode = {"one device": "single device",
            "ZeRO-2": "data-parallel mesh, sharded MuonAdamW (ZeRO-2)",
            "FSDP": "data-parallel mesh, FSDP: params, grads and MuonAdamW state sharded"}
    where = (f"{n} {ctx.devices[0].platform} device(s), "
             + (f"{jax.process_count()} process(es), " if a.distributed else "")
             + mode[ctx.place.mode])
    print(f"model: depth {cfg.n_layer}, width {cfg.n_embd}, {cfg.n_head} heads, "
          f"{_count_params(ctx.abstract_params):,} params, {a.dtype} compute")
    print(f"data:  {ctx.dataset.source}")
    print(f"       {ctx.dataset!r}")
    print(f"run:   {a.steps} steps of {a.batch_size} x {a.seq_len} tokens on {where}")
    print(f"memory per device (estimate): {ctx.estimate.describe()}")


def _estimate_memory(ctx: Context):
    """Params, grads and each optimizer's state per device, from shapes (memory.py):
    MuonAdamW's from ``muon_optax.estimate`` for the run's mode."""
    import memory
    from parallel import state_specs

    params, place, n = ctx.abstract_params, ctx.place, ctx.num_devices
    param_specs = place.param_specs(params) if place.fsdp else None
    state = {}
    for name, _ in ctx.runs:
        if name == "muon":  # estimate() wants axis_name: on one device, a 1-device plan
            tx = _muon_tx(ctx, params, owner_axis=True)
            state[name] = memory.muon_state_bytes(tx, params, n, param_specs)
        else:
            tx, sharded = _make_tx(ctx, name, params)
            state[name] = memory.optimizer_state_bytes(
                tx.init, params, state_specs(place, tx, sharded, params), n)
    return memory.estimate(params, state, param_specs, n)


def _check_fits(ctx: Context) -> None:
    """Refuses, before anything is allocated, a model whose params, grads and optimizer
    state alone exceed a device's memory."""
    import jax
    import memory

    limit, what = memory.device_memory(ctx.devices[0], jax.local_device_count())
    if limit is not None and ctx.estimate.total > limit:
        raise UsageError(
            f"the model does not fit: {_count_params(ctx.abstract_params):,} params need about "
            f"{memory.fmt(ctx.estimate.total)} per device for params, grads and optimizer state "
            f"alone, but {what}; lower --depth{_or_fsdp(ctx)}")


def _out_of_memory_message(ctx: Context) -> str:
    import memory

    a = ctx.args
    return (f"out of memory on {ctx.devices[0].platform}: {_count_params(ctx.abstract_params):,} "
            f"params (about {memory.fmt(ctx.estimate.total)} per device for params, grads and "
            f"optimizer state) and the activations of {a.batch_size // ctx.num_devices} x "
            f"{a.seq_len} tokens per device do not fit; lower --batch-size, --seq-len or "
            f"--depth, or use --dtype bfloat16{_or_fsdp(ctx)}")


def _or_fsdp(ctx: Context) -> str:
    """The advice to shard the params too, where it would help."""
    return "" if ctx.place.fsdp or ctx.num_devices == 1 else (
        f", or split params, grads and state over the {ctx.num_devices} devices with --fsdp")


def _prepare_out(ctx: Context) -> None:
    """Creates ``--out`` and checks that it and the checkpoint directories take a file;
    then a fresh start (no ``--resume``) removes an earlier run's checkpoints and its
    ``adamw/`` run."""
    from checkpoints import check_writable

    a, out = ctx.args, Path(ctx.args.out)
    if ctx.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out {a.out}: cannot create the directory ({e})") from None
        try:
            for path in [out] + [d / "ckpt" for _, d in ctx.runs if (d / "ckpt").is_dir()]:
                check_writable(path)
        except CheckpointError as e:
            raise UsageError(str(e)) from None
        stale = [p for p in (out / "ckpt", out / "adamw") if p.exists()] if not a.resume else []
        if stale:
            print(f"starting afresh: removing {' and '.join(str(p.resolve()) for p in stale)} "
                  f"of an earlier run (pass --resume to continue it)")
        for path in stale:
            _remove(path)
    _sync(ctx, "train.py: output directory ready")


def _remove(path: Path) -> None:
    """Removes an earlier run's ``path``; a symbolic link to a directory (checkpoints kept
    on another disk) stays, emptied."""
    try:
        if path.is_symlink() and path.is_dir():
            for child in path.iterdir():
                _remove(child)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as e:
        raise UsageError(f"cannot remove {path} of an earlier run ({e.strerror}); remove it "
                         f"yourself, or pass --resume to continue that run") from None


def _sync(ctx: Context, name: str) -> None:
    """All processes meet here (no-op with one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _config_record(ctx: Context, status: str, results: dict) -> dict:
    """``config.json``: the command line's settings with the values actually used."""
    import jax
    from optim_setup import make_groups

    a = ctx.args
    groups = make_groups(ctx.cfg.n_embd, total_steps=a.steps, warmup_steps=ctx.warmup_steps,
                         lr_scale=ctx.lr_scale, embedding_lr=a.embedding_lr,
                         unembedding_lr=a.unembedding_lr, matrix_lr=a.matrix_lr,
                         scalar_lr=a.scalar_lr, weight_decay=a.weight_decay, schedules=False)
    learning_rates = {f"muon/{name}": g["lr"] for name, g in groups.items()}
    if a.compare:
        learning_rates["adamw"] = a.adamw_lr
    record = dict(vars(a))
    record.update(
        data=str(Path(a.data).resolve()) if a.data else sysconfig.get_paths()["stdlib"],
        max_bytes=a.max_bytes if a.max_bytes or a.data else DEFAULT_MAX_BYTES,
        corpus_bytes=len(ctx.dataset.train) + len(ctx.dataset.val),
        warmup_steps=ctx.warmup_steps, lr_scale=ctx.lr_scale, learning_rates=learning_rates,
        devices=ctx.num_devices, processes=jax.process_count(), mode=ctx.place.mode,
        params=_count_params(ctx.abstract_params),
        memory_per_device={"params": ctx.estimate.params, "grads": ctx.estimate.grads,
                           "optimizer_state": ctx.estimate.state},
        command=ctx.argv, status=status,
        steps_done={name: r["end"] for name, r in results.items()})
    return record


def _write_config(ctx: Context, status: str, results: dict) -> None:
    from report import write_json

    if ctx.is_main:
        write_json(Path(ctx.args.out) / "config.json", _config_record(ctx, status, results))


def _record_failure(ctx: Context, error: Exception) -> None:
    """``config.json``'s status becomes the failure; where that write fails too (the disk
    that failed the checkpoint is full, ``--out`` is gone), the error's one line says so
    instead of a second traceback."""
    from checkpoints import write_problem

    try:
        _write_config(ctx, f"failed: {error}", {})
    except OSError as e:
        out = Path(ctx.args.out)
        why = (f"{out} is gone" if not out.is_dir() else write_problem(e))
        error.args = (f"{error}; config.json still says \"running\" ({why})",)


# ----------------------------------------------------------------------------- the job


def _train_all(args: argparse.Namespace, dataset: ByteDataset, argv: list[str]) -> int:
    ctx = _setup(args, dataset, argv)
    if args.aot:  # compile for a TPU slice, run nothing, leave --out alone
        from aot import dry_run

        return dry_run(ctx, lambda name: _build_steps(ctx, *_make_tx(ctx, name,
                                                                     ctx.abstract_params)),
                       UsageError)
    _prepare_out(ctx)
    _write_config(ctx, "running", {})
    t_start = time.perf_counter()
    try:
        results, status, received = _run_optimizers(ctx)
    except (UsageError, CheckpointError, LogWriteError, RunFailed) as e:  # not "running"
        _record_failure(ctx, e)
        raise
    return _finish(ctx, results, status, received, time.perf_counter() - t_start)


def _run_optimizers(ctx: Context) -> tuple[dict, int, list[int]]:
    """Trains each optimizer in turn; stops early on a signal or a diverged run.

    Returns the runs' results, the exit status the processes agreed on after a signal (0
    for none) and what each process received.
    """
    import memory

    results, status, received = {}, 0, []
    try:
        with StopSignals(ctx.args.distributed) as stop:
            for name, run_dir in ctx.runs:
                results[name] = _train_one(ctx, name, run_dir, stop)
                status, received = stop.agreed_status(results[name]["stopped"])
                if status or results[name]["diverged"]:
                    break
    except Exception as e:
        if memory.is_out_of_memory(e):
            raise UsageError(_out_of_memory_message(ctx)) from None
        if ctx.args.distributed and _is_peer_lost(e):
            raise RunFailed(_peer_lost_message(ctx, e)) from None
        raise
    return results, status, received


_PEER_LOST = ("gloo", "connection reset", "connection closed", "connection refused",
              "unavailable", "heartbeat", "deadline_exceeded", "coordination service")


def _is_peer_lost(error: BaseException) -> bool:
    """Whether ``error`` is a collective or jax's coordination service losing a process."""
    text = str(error).lower()
    return any(word in text for word in _PEER_LOST)


def _peer_lost_message(ctx: Context, error: BaseException) -> str:
    import jax

    text = str(error)
    # Gloo names the peer's address, not its index; of two processes it is the other one.
    who = (f"process {1 - jax.process_index()}" if jax.process_count() == 2
           else "another process of the run")
    first = (text.strip().splitlines() or [type(error).__name__])[0][:160]
    return (f"lost contact with {who} ({first}); restart every process with --resume: it "
            f"continues from the last checkpoint in {Path(ctx.args.out).resolve() / 'ckpt'}")


def _stop_message(ctx: Context, name: str, result: dict, status: int, received: list) -> str:
    by = [i for i, code in enumerate(received) if code == status]
    who = SIGNAL_NAMES[status]
    if ctx.args.distributed:
        who += (f" on process {', '.join(map(str, by))}" if by
                else ", jax's preemption notice")
    return (f"\n[{name}] interrupted ({who}): checkpoint of step {result['end']} saved in "
            f"{result['ckpt_dir']}; continue with the same command and --resume")


def _finish(ctx: Context, results: dict, status: int, received: list, elapsed: float) -> int:
    """config.json, plot, summary; returns the exit status."""
    from report import plot, read_log, summary_lines

    diverged = any(r["diverged"] for r in results.values())
    if ctx.is_main:
        state = ({EXIT_SIGINT: "interrupted (SIGINT)", EXIT_SIGTERM: "stopped (SIGTERM)"}
                 .get(status) or ("diverged" if diverged else "finished"))
        _write_config(ctx, state, results)
        if status:
            name = list(results)[-1]
            print(_stop_message(ctx, name, results[name], status, received), file=sys.stderr)
        png = Path(ctx.args.out) / "loss.png"
        a = ctx.args
        title = (f"GPT depth {a.depth}, batch {a.batch_size} x {a.seq_len} bytes, "
                 f"{ctx.num_devices} device{'s' if ctx.num_devices > 1 else ''}")
        plot([(name, read_log(d / "log.jsonl")) for name, d in ctx.runs
              if (d / "log.jsonl").exists()], png, title, a.adamw_lr)
        print(f"\nfinished in {elapsed:.0f} s")
        for name, _ in ctx.runs:
            if name in results:
                print("\n".join(summary_lines(name, results[name], a.batch_size * a.seq_len)))
        print(f"  plot: {png}")
    return status or (EXIT_DIVERGED if diverged else 0)


# ----------------------------------------------------------------------------- optimizers


def _config_key(ctx: Context, name: str) -> dict:
    """The settings a checkpoint must share with the run that resumes it."""
    a = ctx.args
    key = {k: getattr(a, k) for k in (
        "steps", "seed", "depth", "head_dim", "batch_size", "seq_len", "dtype", "max_bytes",
        "warmdown_frac", "final_lr_frac")}
    # Not the device count nor the mode: the checkpoint's state is portable.
    # The data by path and by content: a file rewritten in place is another corpus.
    key.update(data=str(Path(a.data).resolve()) if a.data else None,
               data_read=ctx.dataset.fingerprint, warmup_steps=ctx.warmup_steps,
               optimizer=name)
    if name == "muon":
        key.update({k: getattr(a, k) for k in (
            "matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay",
            "lr_scale", "muon_blocks")})
    else:
        key.update(adamw_lr=a.adamw_lr)
    return key


def _muon_tx(ctx: Context, params, owner_axis: bool):
    """nanochat's MuonAdamW for the run's mode: on one device plain; under ZeRO-2 with
    ``axis_name="data"`` (inside the step's ``shard_map``); under FSDP with the mesh and
    the params' split, for plain ``jax.jit``. ``owner_axis`` forces ``axis_name`` (the
    form ``muon_optax.estimate`` plans with)."""
    from optim_setup import make_optimizer

    a, place = ctx.args, ctx.place
    sharded = owner_axis or place.mesh is not None
    return make_optimizer(
        params, ctx.cfg, total_steps=a.steps, warmup_steps=ctx.warmup_steps,
        lr_scale=ctx.lr_scale, warmdown_frac=a.warmdown_frac, final_lr_frac=a.final_lr_frac,
        embedding_lr=a.embedding_lr, unembedding_lr=a.unembedding_lr,
        matrix_lr=a.matrix_lr, scalar_lr=a.scalar_lr, weight_decay=a.weight_decay,
        heads_per_block=heads_per_block(a), axis_name="data" if sharded else None,
        mesh=place.mesh if place.fsdp else None,
        param_specs=place.param_specs(params) if place.fsdp else None)


def _make_tx(ctx: Context, name: str, params):
    """(transformation, sharded): nanochat's MuonAdamW, or the optax.adamw baseline."""
    import jax
    import optax
    from optim_setup import lr_multiplier, param_labels

    a = ctx.args
    if name == "muon":
        return _muon_tx(ctx, params, owner_axis=False), ctx.mesh is not None
    # AdamW baseline: GPT-style betas, decoupled weight decay 0.1 on the block matrices only,
    # the same warmup / warmdown shape as MuonAdamW's lr multiplier.
    mult = lr_multiplier(a.steps, ctx.warmup_steps, a.warmdown_frac, a.final_lr_frac)
    mask = jax.tree.map(lambda label: label == "matrix", param_labels(params))
    tx = optax.adamw(lambda step: a.adamw_lr * mult(step), b1=0.9, b2=0.95, eps=1e-8,
                     weight_decay=0.1, mask=mask)
    return tx, False


def _peak_lr(ctx: Context, name: str) -> float:
    """The peak learning rate shown beside the loss: the Muon group's, or AdamW's."""
    return ctx.args.matrix_lr * ctx.lr_scale if name == "muon" else ctx.args.adamw_lr


# ----------------------------------------------------------------------------- steps


def _build_steps(ctx: Context, tx, sharded_tx: bool):
    """The run's compiled steps for its mode (``parallel.build_steps``)."""
    from flax import nnx
    from model import loss_fn
    from parallel import build_steps

    graphdef, rest = ctx.graphdef, ctx.rest

    def loss_of(p, x, y):
        return loss_fn(nnx.merge(graphdef, p, rest), x, y)

    return build_steps(ctx.place, tx, sharded_tx, loss_of, ctx.abstract_params)


def _state_form(ctx: Context, name: str, tx, steps):
    """How the run's optimizer state is checkpointed (``checkpoints.StateForm``)."""
    import jax
    from checkpoints import optax_form, portable_form

    abstract_state = jax.eval_shape(steps.init, ctx.abstract_params)
    if name == "muon":
        return portable_form(tx, ctx.abstract_params, abstract_state, steps.state, ctx.place)
    return optax_form(abstract_state, steps.state)


def _scalar(x) -> float:
    """A replicated scalar as a Python float (also when other processes hold copies)."""
    import numpy as np

    return float(np.asarray(x.addressable_data(0)))


# ----------------------------------------------------------------------------- one run


@dataclasses.dataclass
class Run:
    """One optimizer's run: its functions, checkpoints, log and the live state."""

    name: str
    run_dir: Path
    steps: object            # parallel.Steps
    form: object             # checkpoints.StateForm: the state as checkpoints hold it
    ckpts: object            # checkpoints.Checkpoints
    key: dict                # _config_key: what a checkpoint must match
    start: int
    saved: dict | None = None  # the meta of the checkpoint resumed from
    log: object = None       # report.RunLog
    params: object = None
    opt_state: object = None
    train: object = None     # the compiled train step
    peak_lr: float = 0.0
    lr_mult: object = None   # jitted step -> the lr multiplier of that step
    end: int = 0
    stopped: bool = False
    diverged: bool = False
    compile_s: float = 0.0
    train_s: float = 0.0

    def meta(self, step: int, ctx: Context) -> dict:
        import jax

        return {"step": step, "data_position": step, "config": self.key, "state": self.form.kind,
                "written_on": {"devices": ctx.num_devices, "mode": ctx.place.mode,
                               "processes": jax.process_count()}}


def _open_checkpoints(ctx: Context, name: str, run_dir: Path, kind: str):
    """``(checkpoints, start step, the checkpoint's meta)``; ``--resume`` checks that the
    settings match (any device count and mode do) and that the state is of ``kind``."""
    from checkpoints import Checkpoints

    a = ctx.args
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpts = Checkpoints(run_dir / "ckpt", a.keep_ckpts, a.ckpt_every, main=ctx.is_main)
    if a.resume and ckpts.latest() is not None:
        start = _intact_start(ctx, name, ckpts)
    else:
        if a.resume and ctx.is_main:
            print(f"[{name}] --resume: no checkpoint in {ckpts.directory}; starting from step 0")
        return ckpts, 0, None
    meta = ckpts.meta(start)
    saved, key = meta["config"], _config_key(ctx, name)
    diff = {k: (saved[k], v) for k, v in key.items() if k in saved and saved[k] != v}
    problem = None
    if "data_read" in diff:
        then, now = diff["data_read"]
        problem = (f"was written on other data: {then} were read then, {now} now (the file "
                   f"changed); restore the data, or start afresh without --resume")
    elif diff:
        problem = ("was written with other settings: " + ", ".join(
            f"{k}={old!r} (now {new!r})" for k, (old, new) in diff.items()))
    elif meta.get("state") != kind:
        problem = ("holds the optimizer state in another form (an earlier train.py's, tied to "
                   "its device count); start afresh without --resume")
    if problem:
        ckpts.close()
        raise UsageError(f"--resume: the checkpoint in {ckpts.directory / str(start)} {problem}")
    return ckpts, start, meta


def _intact_start(ctx: Context, name: str, ckpts) -> int:
    """The newest checkpoint whose files match their checksum; newer, damaged ones are
    set aside with a line each; none intact: refused in one line."""
    start, damaged = ckpts.find_intact()
    if start is None:
        ckpts.close()
        raise UsageError(f"--resume: no intact checkpoint in {ckpts.directory} (" + "; ".join(
            f"step {step}: {problem}" for step, problem in damaged)
            + "); start afresh without --resume")
    if damaged:
        _sync(ctx, "train.py: checkpoints verified")  # every process has read them
        if ctx.is_main:
            for (step, problem), aside in zip(damaged, ckpts.set_aside(damaged), strict=True):
                print(f"train.py: [{name}] checkpoint of step {step} is damaged ({problem}): "
                      f"moved to {aside}; resuming from step {start}", file=sys.stderr)
        _sync(ctx, "train.py: damaged checkpoints set aside")
    ckpts.adopt(start)
    return start


def _initial_state(ctx: Context, run: Run) -> None:
    """Fresh params and optimizer state, or the checkpoint's, placed for the train step.

    A checkpoint is read into arrays placed as this run's steps take them (restore
    targets from shapes, with this run's shardings; orbax reads each device's part),
    then its portable state is laid out for this run's devices and mode.
    """
    import jax
    from checkpoints import with_shardings

    if run.start == 0:
        run.params = ctx.init_params()  # the same seed, the same init for every optimizer
        run.opt_state = run.steps.init(run.params)
        return
    try:
        run.params, saved = run.ckpts.restore(
            run.start, with_shardings(ctx.abstract_params, run.steps.params), run.form.target)
        run.opt_state = run.form.load(saved)
    except ValueError as e:  # e.g. a checkpoint of other shapes
        run.ckpts.close()
        raise UsageError(f"--resume: cannot restore {run.ckpts.directory / str(run.start)}: "
                         f"{e}") from None
    if ctx.is_main:
        was = run.saved.get("written_on", {})
        now = {"devices": ctx.num_devices, "mode": ctx.place.mode,
               "processes": jax.process_count()}
        moved = "" if was == now else (f"; written on {_on(was)}, continued on {_on(now)}")
        print(f"[{run.name}] resumed from {run.ckpts.directory / str(run.start)} "
              f"(step {run.start}{moved})")


def _on(where: dict) -> str:
    """``{"devices": 2, "mode": "FSDP", "processes": 1}`` -> ``2 devices (FSDP)``."""
    n, p = where.get("devices", "?"), where.get("processes", 1)
    procs = f" in {p} processes" if p != 1 else ""
    return f"{n} device{'s' if n != 1 else ''}{procs} ({where.get('mode', '?')})"


def _open_run(ctx: Context, name: str, run_dir: Path) -> Run:
    import jax
    from checkpoints import OPTAX, PORTABLE
    from optim_setup import lr_multiplier

    a = ctx.args
    tx, sharded = _make_tx(ctx, name, ctx.abstract_params)
    ckpts, start, saved = _open_checkpoints(ctx, name, run_dir,
                                            PORTABLE if name == "muon" else OPTAX)
    steps = _build_steps(ctx, tx, sharded)
    run = Run(name, run_dir, steps, _state_form(ctx, name, tx, steps), ckpts,
              _config_key(ctx, name), start, saved, end=start, peak_lr=_peak_lr(ctx, name))
    run.lr_mult = jax.jit(lr_multiplier(a.steps, ctx.warmup_steps, a.warmdown_frac,
                                        a.final_lr_frac))
    return run


def _train_one(ctx: Context, name: str, run_dir: Path, stop: StopSignals) -> dict:
    """Trains one optimizer from the shared init, or from its checkpoint with --resume."""
    run = _open_run(ctx, name, run_dir)
    stop.register(run.start)
    _initial_state(ctx, run)
    run.log = _open_log(ctx, run)
    if run.start == 0:
        run.log.write({"step": 0, **_evaluate(ctx, run)})
    if run.start >= ctx.args.steps:
        if ctx.is_main:
            print(f"[{name}] already trained for {run.start} steps; nothing to do")
    else:
        try:
            _run_steps(ctx, run, stop)
        except LogWriteError:
            run.ckpts.close()  # the checkpoint being written is finished and sealed
            raise
    run.ckpts.close()
    run.log.close()
    return {"stopped": run.stopped, "diverged": run.diverged, "start": run.start,
            "end": run.end, "compile_s": run.compile_s, "train_s": run.train_s,
            "records": run.log.records, "ckpt_dir": run.ckpts.directory,
            "log": run_dir / "log.jsonl"}


def _open_log(ctx: Context, run: Run):
    """``log.jsonl`` from the start step on; a last line cut by a crash is dropped with a
    line saying so, other damage is refused in one line."""
    from report import LogError, RunLog

    try:
        log = RunLog(run.run_dir / "log.jsonl", run.start, ctx.is_main)
    except LogError as e:
        run.ckpts.close()
        raise UsageError(f"--resume: {e}") from None
    if log.cut is not None and ctx.is_main:
        text = log.cut if len(log.cut) <= 60 else log.cut[:57] + "..."
        print(f"train.py: [{run.name}] the last line of {log.path} was cut off (a crash or a "
              f"full disk while it was written): dropped it ({text!r}); resuming from step "
              f"{run.start}", file=sys.stderr)
    return log


def _evaluate(ctx: Context, run: Run) -> dict:
    place = ctx.place
    res = ctx.dataset.evaluate(
        lambda x, y: _scalar(run.steps.eval(run.params, place.batch(x), place.batch(y))),
        max_batches=ctx.args.eval_batches)
    return {"val_loss": res["loss"], "val_bpb": res["bpb"]}


def _compile(ctx: Context, run: Run) -> None:
    x0, y0 = ctx.dataset.batch(run.start)
    t0 = time.perf_counter()
    run.train = run.steps.train.lower(run.params, run.opt_state, ctx.place.batch(x0),
                                      ctx.place.batch(y0)).compile()
    run.compile_s = time.perf_counter() - t0
    if ctx.is_main:
        print(f"[{run.name}] train step compiled in {run.compile_s:.1f} s")


def _step(ctx: Context, run: Run, step: int) -> dict:
    """Trains on step ``step``'s batch; returns its log record."""
    import numpy as np

    t0 = time.perf_counter()
    x, y = ctx.dataset.batch(step)
    run.params, run.opt_state, loss = run.train(run.params, run.opt_state, ctx.place.batch(x),
                                                ctx.place.batch(y))
    loss = _scalar(loss)
    dt = time.perf_counter() - t0
    run.train_s += dt
    mult = float(run.lr_mult(np.int32(step)))
    return {"step": step + 1, "loss": loss, "lr_mult": mult, "lr": run.peak_lr * mult,
            "tokens_per_s": ctx.args.batch_size * ctx.args.seq_len / dt}


def _run_steps(ctx: Context, run: Run, stop: StopSignals) -> None:
    """The training loop: step, evaluate, log, checkpoint; stops as ``stop`` agrees."""
    from tqdm.auto import tqdm

    a = ctx.args
    _compile(ctx, run)
    bar = tqdm(total=a.steps, initial=run.start, desc=run.name, unit="step",
               dynamic_ncols=True, disable=a.no_progress or not ctx.is_main)
    for step in range(run.start, a.steps):
        record = _step(ctx, run, step)
        done = step + 1
        if not math.isfinite(record["loss"]):  # the same (global) loss on every process
            run.log.write(record)
            run.diverged, run.end = True, done
            bar.close()
            if ctx.is_main:
                print(f"[{run.name}] the loss is {record['loss']} at step {done}: training "
                      f"diverged (lower the learning rates)", file=sys.stderr)
            break
        if done == a.steps or (a.eval_every and done % a.eval_every == 0):
            record.update(_evaluate(ctx, run))
            if ctx.is_main:
                bar.write(f"[{run.name}] step {done}: val loss {record['val_loss']:.4f} "
                          f"(bpb {record['val_bpb']:.3f})")
        run.log.write(record)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                        lr=f"{record['lr']:.2e}", refresh=False)
        run.end = done
        run.stopped = stop.reached(done)  # every process: the same answer at this step
        run.ckpts.save(done, run.params, lambda: run.form.save(run.opt_state),
                       run.meta(done, ctx), stop=run.stopped, force=done == a.steps)
        if run.stopped:
            break
    bar.close()


if __name__ == "__main__":
    sys.exit(main())
