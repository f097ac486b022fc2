"""Does the sharded program grow with the device count? Compile time and size against N.

The ZeRO-2 step (``muon_adamw(axis_name="data")`` inside ``shard_map``, update + apply,
params and state donated, each device's own gradients) of a nanochat-like set, compiled for
N simulated CPU devices: the compile time (median of ``--reps`` compiles, each of a fresh
lowering), the optimized HLO's instruction count, its conditional Muon slots, and at the
smallest N the step time. ``--against COMMIT`` imports that commit's ``muon_optax`` too
(``git archive``, under another package name) and measures both in the same process, the
steps timed in the same interleaved rounds, to compare before and after:

  PYTHONPATH=. python benchmarks/compile_scaling.py --devices 8 16 32 64 --against 893deec
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--set", default="d256x4", help="nanochat-like set d<width>x<layers>")
    p.add_argument("--reps", type=int, default=3, help="compiles per N (step rounds: 10 x reps)")
    p.add_argument("--against", default=None, help="an older commit to measure beside this one")
    p.add_argument("--quick", action="store_true", help="d64x2, N = 2 and 4, one rep")
    return p.parse_args(argv)


def _stepper(compiled, params, state, grads):
    """A call of the donated step that carries its params and state to the next call."""
    import jax

    box = [params, state]

    def run():
        box[0], box[1] = compiled(box[0], box[1], grads)
        jax.block_until_ready(box[0])
    return run


def measure(library, args, params, grads) -> tuple[list[list], object]:
    """Per N: median compile seconds, HLO instructions, conditionals; and the step at the
    first N as a callable."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks import common

    groups = common.nanochat_groups(common.parse_set(args.set)[0])
    tx = library.muon_adamw(groups, common.nanochat_labels(params), axis_name="data")
    rows, run = [], None
    for n in args.devices:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:n])
        specs = library.state_specs(tx, params, mesh)
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
        own = jax.device_put(jax.tree.map(lambda g: np.stack([g] * n), grads),
                             NamedSharding(mesh, P("data")))

        def lowered():  # a new function each time: nothing comes from jax's caches
            def step(p, s, g):
                u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
                return optax.apply_updates(p, u), s
            return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                         out_specs=(P(), specs)),
                           donate_argnums=(0, 1)).lower(params, state, own)

        times = []
        for _ in range(args.reps):
            low = lowered()
            t0 = time.perf_counter()
            compiled = low.compile()
            times.append(time.perf_counter() - t0)
        hlo = compiled.as_text()
        rows.append([n, f"{statistics.median(times):.2f}", hlo.count("\n  %"),
                     hlo.count(" conditional(")])
        if run is None:
            run = _stepper(compiled, jax.tree.map(jnp.copy, params), state, own)
            run()
    return rows, run


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.quick:
        args.devices, args.set, args.reps = [2, 4], "d64x2", 1
    flag = "--xla_force_host_platform_device_count"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={max(args.devices)}"
    import muon_optax
    from benchmarks import common

    params = common.nanochat_params(*common.parse_set(args.set), 4096)
    grads = common.random_grads(params)
    with tempfile.TemporaryDirectory() as folder:
        libraries = {"this": muon_optax}
        if args.against:
            libraries[args.against] = common.import_commit(args.against, folder)
        print(f"# compile scaling: {args.set}, ZeRO-2 step; {common.machine_line()}\n")
        rows, runs = [], {}
        for name, library in libraries.items():
            lib_rows, runs[name] = measure(library, args, params, grads)
            rows += [[name] + r for r in lib_rows]
        print(common.md_table(["library", "N", "compile s", "HLO instructions", "conditionals"],
                              rows, "lrrrr"))
        times = common.time_interleaved(runs, 10 * args.reps)
        print(f"\nStep at N = {args.devices[0]}, {10 * args.reps} interleaved rounds: "
              + ", ".join(f"{k} {1e3 * statistics.median(v):.0f} ms" for k, v in times.items()))
        if args.against:
            r = common.ratio_stats(times["this"], times[args.against])
            print(f"this / {args.against}: median per-rep ratio {r['median']:.3f} "
                  f"(min {r['min']:.3f}, max {r['max']:.3f})")


if __name__ == "__main__":
    main()
