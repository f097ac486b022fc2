"""Which axis should ZeRO-2 split a large AdamW parameter on? Leading against minor.

One AdamW-only parameter (a vocab x width embedding, vocab not a multiple of N) on N
simulated CPU devices, the ZeRO-2 step inside ``shard_map`` (update + apply, donated),
compiled twice with the split axis forced to 0 and to 1; interleaved median step time,
the optimized HLO's transposes and copies, and the temporaries:

  PYTHONPATH=. python benchmarks/split_axis.py                   # (32001, 512), N = 8
"""

import argparse
import os

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--shape", type=int, nargs=2, default=[32001, 512])
p.add_argument("--devices", type=int, default=8)
p.add_argument("--reps", type=int, default=15)
args = p.parse_args()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import muon_optax  # noqa: E402
import muon_optax.plan as plan_module  # noqa: E402
from benchmarks import common  # noqa: E402

n, shape = args.devices, tuple(args.shape)
mesh = jax.make_mesh((n,), ("data",))
params = {"wte": jnp.full(shape, 0.01, jnp.float32)}
groups = {"a": dict(kind="adamw", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)}
grads = jax.device_put({"wte": jnp.full((n,) + shape, 1e-3, jnp.float32)},  # each device's own
                       NamedSharding(mesh, P("data")))


def compiled_step(axis):
    plan_module.adamw_shard_axis = lambda shape, num_devices, threshold: axis
    tx = muon_optax.muon_adamw(groups, lambda p: {"wte": "a"}, axis_name="data")
    specs = muon_optax.state_specs(tx, params, mesh)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                              out_specs=(P(), specs)), donate_argnums=(0, 1))
    state, p = init(params), jax.tree.map(jnp.copy, params)
    compiled = f.lower(p, state, grads).compile()
    hlo = compiled.as_text()
    box = [p, state]

    def call():
        box[0], box[1] = compiled(box[0], box[1], grads)
        jax.block_until_ready(box[0])
    call()
    return call, hlo.count(" transpose(") + hlo.count(" copy("), common.memory_of(compiled)


runs = {f"axis {a}": compiled_step(a) for a in (0, 1)}
times = common.time_interleaved({k: v[0] for k, v in runs.items()}, args.reps)
print(f"# {shape} on {n} devices, {args.reps} interleaved reps; {common.machine_line()}")
for k, (_, ops, mem) in runs.items():
    ms = sorted(times[k])[len(times[k]) // 2] * 1e3
    print(f"{k}: median {ms:.1f} ms, transposes + copies {ops}, temp {mem['temp'] / 2**20:.1f} MiB")
r = common.ratio_stats(times["axis 1"], times["axis 0"])
print(f"minor / leading: median per-rep ratio {r['median']:.3f} (min {r['min']:.3f}, "
      f"max {r['max']:.3f})")
