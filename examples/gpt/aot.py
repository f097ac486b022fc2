"""``--aot TOPOLOGY``: the main job's train step compiled for a TPU slice, without a TPU.

A dry run: the model, the optimizer and the train step are built exactly as a real run
builds them for its mode (one device, ZeRO-2, FSDP), then the whole step (forward,
backward, optimizer) is lowered on ``jax.ShapeDtypeStruct`` s placed on compile-only TPU
devices (``jax.experimental.topologies``) and compiled by the TPU compiler (``libtpu``).
Nothing is allocated and nothing runs; ``--out`` is not touched. Per chip it prints the
params, gradients and optimizer state (from shapes, as the run's memory line), the
compiled program's arguments, outputs and temporaries against the chip's HBM, and the
step's collectives (count, payload and the bytes each chip sends on a ring; one inside a
loop counted by its trip count).

The exit status is 0 when the step fits in the chip's HBM, 2 (as a real run's refusal)
when it does not.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Short names (benchmarks/tpu_compile.py's): topology, and how many of its chips are used.
SHORT_NAMES = {"v5p:1": ("v5p:2x2x1", 1), "v5p:8": ("v5p:2x2x2", 8),
               "v5p:64": ("v5p:4x4x4", 64), "v5e:8": ("v5e:2x4", 8), "v6e:8": ("v6e:2x4", 8)}
HBM = {"v5p": 95 * 2**30, "v5e": 16 * 2**30, "v6e": 32 * 2**30}   # bytes per chip
LIBTPU_MISSING = ('--aot needs libtpu, the TPU compiler: pip install -e ".[tpu]" (the libtpu '
                  "of jax's newest line, which needs Python 3.12 or newer)")
_QUIET_LIBTPU = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_ACCELERATOR_TYPE": "v5p-8",
                 "TPU_WORKER_HOSTNAMES": "localhost"}


def check(args, usage_error) -> None:
    """Before jax is imported: the flags a dry run can take, and libtpu installed.
    ``usage_error`` is the caller's exception for a one-line usage error."""
    if args.distributed:
        raise usage_error("--aot compiles on this machine for the TPU slice it names; "
                          "drop --distributed")
    if args.devices != 1:
        raise usage_error(f"--aot takes the chips from the topology it names (e.g. --aot "
                          f"v5p:2x2x2 for 8); drop --devices {args.devices}")
    if importlib.util.find_spec("libtpu") is None:
        raise usage_error(LIBTPU_MISSING)
    for key, value in _QUIET_LIBTPU.items():   # libtpu looks for a TPU host otherwise
        os.environ.setdefault(key, value)


def topology_devices(name: str, usage_error) -> list:
    """The compile-only devices of ``name``: a short name of ``SHORT_NAMES`` or any name
    ``jax.experimental.topologies.get_topology_desc`` takes (``v5p:2x2x2``, ``v5e:2x4``)."""
    from jax.experimental import topologies

    topology, count = SHORT_NAMES.get(name, (name, None))
    try:
        devices = list(topologies.get_topology_desc(topology_name=topology,
                                                    platform="tpu").devices)
    except Exception as e:   # jax raises several kinds for a bad name
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise usage_error(f"--aot {name}: not a TPU topology libtpu knows ({first}); try "
                          f"v5p:2x2x2, v5e:2x4, v6e:2x4 or one of {', '.join(SHORT_NAMES)}"
                          ) from None
    return devices[:count] if count else devices


def hbm_of(name: str) -> int | None:
    """One chip's HBM for a topology name (its generation, before the colon)."""
    return HBM.get(name.split(":")[0].lower())


def _gib(n: float) -> str:
    """Bytes in powers of 1024, as HBM is quoted: 1.25 GiB, 310.4 MiB, 12.0 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _abstract(tree, sharding):
    """``tree`` as ``ShapeDtypeStruct`` s placed as ``sharding`` says (one, or a tree)."""
    import jax

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, sharding)


def compile_step(ctx, steps):
    """``(compiled train step, (wall seconds, CPU seconds))`` for ``steps``
    (``parallel.Steps``) of ``ctx``: lowering and compiling. The CPU time (all of this
    process's threads) varies less than the wall time on a shared machine."""
    import jax
    import jax.numpy as jnp

    a = ctx.args
    params = _abstract(ctx.abstract_params, steps.params)
    state = _abstract(jax.eval_shape(steps.init, ctx.abstract_params), steps.state)
    batch = jax.ShapeDtypeStruct((a.batch_size, a.seq_len), jnp.int32, sharding=ctx.place.rows)
    t0, c0 = time.perf_counter(), time.process_time()
    compiled = steps.train.lower(params, state, batch, batch).compile()
    return compiled, (time.perf_counter() - t0, time.process_time() - c0)


def collectives(compiled, num_devices: int) -> dict[str, dict[str, float]]:
    """The step's collectives per kind (``benchmarks.tpu_compile.loop_collectives``)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks.tpu_compile import loop_collectives

    return loop_collectives(compiled.as_text(), num_devices)


def report(ctx, name: str, compiled, seconds: tuple[float, float]) -> tuple[list[str], bool]:
    """The lines printed for one optimizer's step, and whether it fits in HBM."""
    a, est, n = ctx.args, ctx.estimate, ctx.num_devices
    mem = compiled.memory_analysis()
    args_b, out_b = mem.argument_size_in_bytes, mem.output_size_in_bytes
    temp_b, alias_b = mem.temp_size_in_bytes, mem.alias_size_in_bytes
    peak = args_b + temp_b + out_b - alias_b
    hbm = hbm_of(a.aot)
    chips = f"{n} chip{'s' if n > 1 else ''}, {ctx.devices[0].device_kind}"
    lines = [
        f"[{name}] --aot {a.aot} ({chips}), {ctx.place.mode}: the train step (forward, "
        f"backward, optimizer) compiled by the TPU compiler in {seconds[0]:.1f} s ("
        f"{seconds[1]:.1f} s of CPU); nothing ran",
        f"  per chip, from shapes: params {_gib(est.params)}, grads {_gib(est.grads)}, "
        f"optimizer state {_gib(est.state[name])}",
        f"  per chip, compiled: arguments {_gib(args_b)} (params, optimizer state, batch), "
        f"outputs {_gib(out_b)} ({_gib(alias_b)} of them in the donated arguments), "
        f"temporaries {_gib(temp_b)} (grads, activations, the optimizer's work)"]
    fits = hbm is None or peak <= hbm
    if hbm is None:
        lines.append(f"  peak about {_gib(peak)} (arguments + temporaries + outputs not in "
                     f"the arguments); this chip's HBM is unknown here")
    else:
        lines.append(f"  peak about {_gib(peak)} (arguments + temporaries + outputs not in "
                     f"the arguments) of {hbm / 2**30:.0f} GiB HBM: {100 * peak / hbm:.1f}%, "
                     + ("fits" if fits else "DOES NOT FIT"))
    ops = collectives(compiled, n)
    if ops:
        lines.append("  collectives per step: " + "; ".join(
            f"{v['count']:.0f} {op} ({_gib(v['bytes'])}, {_gib(v['ring'])} sent per chip)"
            for op, v in sorted(ops.items())))
    else:
        lines.append("  collectives per step: none")
    return lines, fits


def _advice(ctx) -> str:
    """What would make the step smaller, for this run."""
    moves = ["lower --batch-size, --seq-len or --depth"]
    if ctx.args.dtype == "float32":
        moves.append("use --dtype bfloat16")
    if ctx.num_devices > 1 and not ctx.place.fsdp:
        moves.append("split params, grads and state over the chips with --fsdp")
    return ", or ".join(moves)


def dry_run(ctx, build_steps, usage_error) -> int:
    """Compiles each of the run's optimizers' train steps (``build_steps(name)`` ->
    ``parallel.Steps``) for the topology and prints :func:`report`; 0 if every step
    fits in a chip's HBM, else 2 after a line that says so."""
    import jax
    import memory

    if ctx.place.mesh is None:   # one chip: the Layout's default device is the host's
        ctx.place.replicated = ctx.place.rows = jax.sharding.SingleDeviceSharding(
            ctx.devices[0])
    fits = True
    for name, _ in ctx.runs:
        try:
            compiled, seconds = compile_step(ctx, build_steps(name))
        except Exception as e:
            if memory.is_out_of_memory(e):
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise usage_error(f"--aot {ctx.args.aot}: the train step does not fit a chip "
                                  f"({first}); {_advice(ctx)}") from None
            raise
        lines, ok = report(ctx, name, compiled, seconds)
        print("\n".join(lines), flush=True)
        fits = fits and ok
    if not fits:
        print(f"train.py: error: --aot {ctx.args.aot}: the train step does not fit a chip's "
              f"HBM; {_advice(ctx)}", file=sys.stderr)
        return 2
    return 0
