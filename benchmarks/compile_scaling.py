"""Does the sharded program grow with the device count? Compile time and size against N.

The ZeRO-2 step (``muon_adamw(axis_name="data")`` inside ``shard_map``, update + apply, each
device's own gradients) of a nanochat-like set, compiled for N simulated CPU devices: the
compile time (median of ``--reps`` fresh compiles), the optimized HLO's instruction count,
the conditional Muon slots, and at the smallest N the median step time. ``--library DIR``
imports muon_optax from another checkout (e.g. a worktree of an older commit), to compare
before and after:

  PYTHONPATH=. python benchmarks/compile_scaling.py --devices 8 16 32 64
  git worktree add /tmp/old 893deec
  PYTHONPATH=. python benchmarks/compile_scaling.py --library /tmp/old
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--set", default="d256x4", help="nanochat-like set d<width>x<layers>")
    p.add_argument("--reps", type=int, default=3, help="compiles (and step reps x 3) per N")
    p.add_argument("--library", default=None, help="a checkout whose muon_optax to import")
    p.add_argument("--quick", action="store_true", help="d64x2, N = 2 and 4, one rep")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.quick:
        args.devices, args.set, args.reps = [2, 4], "d64x2", 1
    flag = "--xla_force_host_platform_device_count"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={max(args.devices)}"
    if args.library:
        sys.path.insert(0, os.path.abspath(args.library))
    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import muon_optax
    from benchmarks import common

    params = common.nanochat_params(*common.parse_set(args.set), 4096)
    grads = common.random_grads(params)
    groups = common.nanochat_groups(common.parse_set(args.set)[0])
    tx = muon_optax.muon_adamw(groups, common.nanochat_labels(params), axis_name="data")
    print(f"# compile scaling: {args.set}, library {os.path.dirname(muon_optax.__file__)}; "
          f"{common.machine_line()}\n")
    rows = []
    for n in args.devices:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:n])
        specs = muon_optax.state_specs(tx, params, mesh)
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

        def step(p, s, g):
            u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return optax.apply_updates(p, u), s

        own = jax.device_put(jax.tree.map(lambda g: np.stack([g] * n), grads),
                             NamedSharding(mesh, P("data")))
        lowered = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                        out_specs=(P(), specs))).lower(params, state, own)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            compiled = lowered.compile()
            times.append(time.perf_counter() - t0)
        hlo = compiled.as_text()
        row = [n, f"{np.median(times):.1f}", hlo.count("\n  %"), hlo.count(" conditional(")]
        if n == args.devices[0]:
            run = lambda: jax.block_until_ready(compiled(params, state, own))  # noqa: E731
            run()
            times = common.time_interleaved({"step": run}, 3 * args.reps)["step"]
            row.append(f"{1e3 * np.median(times):.0f}")
        rows.append(row + [""] * (5 - len(row)))
    print(common.md_table(["N", "compile s", "HLO instructions", "conditionals",
                           "step ms (first N)"], rows, "rrrrr"))


if __name__ == "__main__":
    main()
