"""What a sharded step costs per device, read from the compiled programs.

On N = 1, 2, 4, 8 simulated CPU devices, each contender's train step (update + apply) is
compiled on a ``("data",)`` mesh. Per device: params and state bytes (addressable shards, max
over devices), FLOPs (``cost_analysis``; a ``lax.scan``'s body counts once), temporaries, and
the collectives in the HLO with the bytes each device sends on a ring, against one ring
all-reduce of the gradients. "x total/N" divides by the contender's own N = 1 figure.

Contenders (``CONTENDERS``: a name -> a function building the step on one mesh):

  muon_optax      ZeRO-2: muon_adamw(axis_name="data") inside shard_map, each device's own
                  unreduced gradients, state sharded by state_specs
  muon_optax_jit  muon_adamw(axis_name="data", mesh=mesh) under plain jit: averaged
                  (replicated) gradients in, its own shard_map inside
  optax_contrib   optax.contrib.muon under plain jit, params, grads and state replicated

A second table gives the Muon load balance analytically, for wider sets too: muon_optax's
stacks against nanochat's DistMuonAdamW (a stack per PyTorch shape, chunks of ceil(K/N)).

  PYTHONPATH=. python benchmarks/sharded.py                       # d256x4, vocab 4096
  PYTHONPATH=. python benchmarks/sharded.py --quick               # d64x2, N = 1, 8
"""

from __future__ import annotations

import os

MAX_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={MAX_DEVICES}".strip()

import dataclasses  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import muon_optax  # noqa: E402
import muon_optax.polar  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import MB, fmt, md_table  # noqa: E402


@dataclasses.dataclass
class Problem:
    """What a contender builds its step from: one mesh and the problem (NumPy)."""
    mesh: jax.sharding.Mesh
    n: int
    params: Any
    grads: Any
    groups: dict[str, Any]
    labels: Any


class Case(NamedTuple):
    """A contender's step on one mesh: ``step(*args)`` returns ``(params, state)``."""
    step: Callable  # jitted
    args: tuple  # (params, state, grads), placed as the contender places them


def _apply(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


def zero2(m: Problem) -> Case:
    tx = muon_optax.muon_adamw(m.groups, m.labels, axis_name="data")
    specs = muon_optax.state_specs(tx, m.params, m.mesh)
    params = jax.device_put(m.params, NamedSharding(m.mesh, P()))
    state = jax.jit(jax.shard_map(tx.init, mesh=m.mesh, in_specs=P(), out_specs=specs))(params)
    own = jax.tree.map(lambda g: np.stack([g] * m.n), m.grads)  # each device's gradients
    own = jax.device_put(own, NamedSharding(m.mesh, P("data")))
    step = _apply(tx)
    return Case(jax.jit(jax.shard_map(lambda p, s, g: step(p, s, jax.tree.map(lambda x: x[0], g)),
                                      mesh=m.mesh, in_specs=(P(), specs, P("data")),
                                      out_specs=(P(), specs))), (params, state, own))


def zero2_jit(m: Problem) -> Case:
    tx = muon_optax.muon_adamw(m.groups, m.labels, axis_name="data", mesh=m.mesh)
    params, grads = jax.device_put((m.params, m.grads), NamedSharding(m.mesh, P()))
    return Case(jax.jit(_apply(tx)), (params, jax.jit(tx.init)(params), grads))


def contrib_replicated(m: Problem) -> Case:
    tx, repl = common.optax_contrib_muon(m.params), NamedSharding(m.mesh, P())
    params, grads = jax.device_put((m.params, m.grads), repl)
    state = jax.jit(tx.init, out_shardings=repl)(params)
    return Case(jax.jit(_apply(tx), out_shardings=(repl, repl)), (params, state, grads))


CONTENDERS: dict[str, Callable[[Problem], Case]] = {
    "muon_optax": zero2, "muon_optax_jit": zero2_jit, "optax_contrib": contrib_replicated}


def parse_args(argv=None):
    ap = common.base_parser(__doc__)
    ap.add_argument("--set", type=common.parse_set, default="d256x4",
                    help="parameter set d<width>x<layers> (default d256x4)")
    ap.add_argument("--devices", default="1,2,4,8",
                    help=f"comma-separated device counts, at most {MAX_DEVICES} (default 1,2,4,8)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated subset of {','.join(CONTENDERS)} (default: all)")
    ap.add_argument("--balance-sets", default="d256x4,d768x12,d768x6,d1664x26",
                    help="sets of the analytic load-balance table (default: d256x4, nanochat's "
                         "d12 and d26, and d768x6)")
    ap.add_argument("--no-run", action="store_true", help="compile only; do not run a step")
    args = ap.parse_args(argv)
    if args.quick:
        args.set, args.vocab, args.devices, args.balance_sets = (64, 2), 256, "1,8", "d256x4"
    args.devices = [int(n) for n in args.devices.split(",")]
    args.contenders = [c for c in args.contenders.split(",") if c]
    args.balance_sets = [common.parse_set(s) for s in args.balance_sets.split(",") if s]
    if max(args.devices) > len(jax.devices()):
        ap.error(f"only {len(jax.devices())} devices (XLA_FLAGS={os.environ['XLA_FLAGS']!r})")
    if set(args.contenders) - set(CONTENDERS):
        ap.error(f"unknown contenders; choose from {list(CONTENDERS)}")
    return args


def measure(case: Case, n: int, run: bool) -> dict[str, Any]:
    """Per-device bytes, FLOPs, temporaries and collectives of one compiled step."""
    devices = jax.devices()[:n]
    compiled = case.step.lower(*case.args).compile()
    out = dict(params=max(common.per_device_bytes(case.args[0], devices)),
               state=max(common.per_device_bytes(case.args[1], devices)),
               flops=common.cost_flops(compiled), temp=common.memory_of(compiled)["temp"],
               collectives=common.collectives(compiled.as_text(), n), finite=None)
    if run:
        new_params, _ = compiled(*case.args)
        out["finite"] = bool(all(np.isfinite(np.asarray(x)).all()
                                 for x in jax.tree.leaves(new_params)))
    return out


def cost_table(args, params, grads) -> list[dict[str, Any]]:
    rows = []
    groups, labels = common.nanochat_groups(args.set[0]), common.nanochat_labels(params)
    for n in args.devices:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:n])
        m = Problem(mesh, n, params, grads, groups, labels)
        for name in args.contenders:
            rows.append(dict(contender=name, n=n, **measure(CONTENDERS[name](m), n,
                                                            not args.no_run)))
            print(f"#   {name}, N={n}: compiled; step finite: {rows[-1]['finite']}", flush=True)
    grad_bytes = common.tree_bytes(grads)
    print(f"\nGradients {grad_bytes / MB:.2f} MiB; one ring all-reduce of them sends "
          "2 (N-1)/N x that per device.\n")
    print(md_table(["contender", "N", "params MiB", "state MiB", "x total/N", "GFLOP",
                    "x total/N", "temp MiB", "collectives (count)", "ring MiB", "x all-reduce"],
                   [_cost_cells(r, rows, grad_bytes) for r in rows], "lrrrrrrrlrr"))
    return rows


def _cost_cells(r: dict[str, Any], rows: list[dict[str, Any]], grad_bytes: int) -> list[str]:
    base = next((b for b in rows if b["contender"] == r["contender"] and b["n"] == 1), None)
    n, ops = r["n"], r["collectives"]
    ring = sum(op["ring"] for op in ops.values())
    all_reduce = 2 * (n - 1) / n * grad_bytes
    return [r["contender"], n, fmt(r["params"] / MB), fmt(r["state"] / MB),
            fmt(base and r["state"] * n / base["state"], ".3f"), fmt(r["flops"] / 1e9),
            fmt(base and r["flops"] * n / base["flops"], ".3f"), fmt(r["temp"] / MB, ".1f"),
            ", ".join(f"{k} {v['count']}" for k, v in sorted(ops.items())) or "none",
            fmt(ring / MB), fmt(ring / all_reduce if n > 1 else None, ".3f")]


# ----------------------------------------------------------------------------- load balance

def balance(width: int, layers: int, n: int) -> dict[str, Any]:
    """Busiest device's Muon FLOPs over total/N: muon_optax (every device runs padded/N slots
    of every stack, in the form it runs on CPU) and nanochat (per PyTorch shape, chunks of
    ceil(K/N) matrices, device d computing min(chunk, K - d chunk) of them, direct form)."""
    shapes = common.nanochat_params(width, layers, 256, abstract=True)
    tx = muon_optax.muon_adamw(common.nanochat_groups(width), common.nanochat_labels(shapes),
                               axis_name="data")
    stacks = common.stack_rows(tx, shapes, num_devices=n)
    ours = sum(r["flops"] // r["stack"][0] * r["stack"][0] // n for r in stacks)
    ours_total = sum(r["flops"] // r["stack"][0] * r["size"] for r in stacks)
    nano, nano_total = np.zeros(n), 0
    per_shape: dict[tuple[int, int], int] = {}
    for fan_in, fan_out in common.block_shapes(width).values():
        per_shape[(fan_out, fan_in)] = per_shape.get((fan_out, fan_in), 0) + layers
    for (r, c), k in per_shape.items():
        f, chunk = muon_optax.polar.polar_flops(r, c, 5, "direct"), -(-k // n)
        nano += [min(chunk, max(0, k - d * chunk)) * f for d in range(n)]
        nano_total += k * f
    return dict(stacks=[r["stack"] for r in stacks], ours=ours * n / ours_total,
                nanochat=float(nano.max()) * n / nano_total,
                nanochat_stacks=[(k, r, c) for (r, c), k in per_shape.items()])


def balance_table(args) -> list[dict[str, Any]]:
    ns = [n for n in args.devices if n > 1]
    rows = [dict(set=f"d{w}x{layers}", **{f"N={n}": balance(w, layers, n) for n in ns})
            for w, layers in args.balance_sets]
    print("\nMuon load balance (analytic): the busiest device's polar FLOPs over total/N, "
          "muon_optax / nanochat.\n")
    print(md_table(["set", f"muon_optax stacks (K, R, C) at N={ns[-1]}"] + [f"N={n}" for n in ns],
                   [[r["set"], ", ".join("x".join(map(str, s)) for s in r[f"N={ns[-1]}"]["stacks"])]
                    + [f"{r[f'N={n}']['ours']:.3f} / {r[f'N={n}']['nanochat']:.3f}" for n in ns]
                    for r in rows], "ll" + "r" * len(ns)))
    return rows


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    params = common.nanochat_params(*args.set, args.vocab, args.dtype)
    print(f"# sharded: d{args.set[0]} x {args.set[1]} layers, vocab {args.vocab}, {args.dtype}; "
          f"N = {args.devices} (simulated CPU devices); {common.machine_line()}", flush=True)
    result = dict(config=vars(args), costs=cost_table(args, params, common.random_grads(params)),
                  balance=balance_table(args))
    common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
