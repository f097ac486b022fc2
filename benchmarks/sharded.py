"""What the sharded (ZeRO-2) step costs per device, read from the compiled programs.

For the nanochat-like set (default d256 x 4 layers, vocab 4096) on N = 1, 2, 4, 8
simulated CPU devices (``--xla_force_host_platform_device_count``), this compiles the
train-step ``shard_map(tx.update + apply)`` of ``muon_optax.muon_adamw(...,
axis_name="data")`` with ``muon_optax.state_specs`` and reports:

* optimizer-state bytes per device, summed over the actual sharded state arrays'
  addressable shards on each device (max over devices);
* FLOPs per device, ``compiled.cost_analysis()["flops"]`` of the per-device program;
* collective bytes per step, parsed from the compiled HLO text (see ``collectives``);
* the same state bytes and FLOPs for ``optax.contrib.muon`` under plain ``jax.jit``
  with params, grads and state replicated (``NamedSharding(mesh, P())``) on the mesh;
* the Muon load balance, analytically: ours (``tx.init.stack_info``, each device runs
  ``padded / N`` slots of every stack, padding included) against nanochat's
  ``DistMuonAdamW`` (one stack per (group, PyTorch shape), ``chunk = ceil(K / N)``
  state slots per device; device d computes its ``min(chunk, K - d * chunk)`` real
  matrices).

Targets, checked per N: state and Muon FLOPs per device <= 1.1 x (total / N);
collective bytes per step <= one ring all-reduce of the gradients.

    PYTHONPATH=. python benchmarks/sharded.py [--n-embd 256 --n-layer 4 --vocab 4096]
"""

from __future__ import annotations

import os

MAX_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform"
                               f"_device_count={MAX_DEVICES}").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import muon_optax  # noqa: E402
import muon_optax.polar  # noqa: E402
from benchmarks.params import (  # noqa: E402
    block_shapes,
    muon_flops,
    nanochat_groups,
    nanochat_labels,
    nanochat_params,
    optax_contrib_muon,
    polar_flops,
    random_grads,
    tree_bytes,
)

TOLERANCE = 1.1  # per-device state and FLOPs may be at most this times total / N
MB = 2 ** 20


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", help="parameter dtype")
    ap.add_argument("--devices", default="1,2,4,8",
                    help=f"comma-separated device counts (at most {MAX_DEVICES})")
    ap.add_argument("--balance-sets", default="256x4,768x12,768x6,1664x26",
                    help="extra WIDTHxLAYERS sets for the (analytic) load-balance table")
    ap.add_argument("--no-run", action="store_true",
                    help="only compile; do not execute one sharded step as a smoke check")
    ap.add_argument("--dump-hlo", help="folder to write each compiled step's HLO text to")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    args.devices = [int(n) for n in args.devices.split(",")]
    if max(args.devices) > len(jax.devices()):
        ap.error(f"only {len(jax.devices())} devices; XLA_FLAGS={os.environ['XLA_FLAGS']!r}")
    args.balance_sets = [tuple(int(v) for v in s.split("x")) for s in
                         args.balance_sets.split(",") if s]
    return args


# ----------------------------------------------------------------------------- HLO

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
COLLECTIVE = re.compile(r"=\s*(?P<type>.*?)\s(?P<op>all-reduce|all-gather|reduce-scatter|"
                        r"all-to-all|collective-permute)(?P<suffix>-start|-done)?\(")
ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")


def _array_bytes(type_str: str) -> list[int]:
    out = []
    for dtype, dims in ARRAY.findall(type_str):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(n * DTYPE_BYTES.get(dtype, 4))
    return out


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len([d for d in m.group(1).split(",") if d])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)  # iota form [groups, size]<=[..]
    if m:
        return int(m.group(2))
    return num_devices


def collectives(hlo: str, num_devices: int) -> dict[str, Any]:
    """Collective ops of a compiled HLO module and the bytes they move per step.

    Convention: an op's *payload* is its full-size (unsharded) buffer: the result of an
    all-reduce or all-gather, the operand of a reduce-scatter (result x group size).
    With a ring over n devices each device sends ``(n-1)/n`` of the payload for a
    reduce-scatter or all-gather and ``2 (n-1)/n`` for an all-reduce; ``ring_bytes`` sums
    that per device. The target, one ring all-reduce of the gradients, is
    ``2 (N-1)/N x grad bytes`` in the same units.
    """
    ops: dict[str, dict[str, float]] = {}
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if not m or m.group("suffix") == "-done":
            continue
        op = m.group("op")
        sizes = _array_bytes(m.group("type"))
        if m.group("suffix") == "-start" and op == "all-gather":
            sizes = sizes[-1:]  # (operand, result) tuple: the result is the full buffer
        n = _group_size(line, num_devices)
        result = sum(sizes)
        payload = result * n if op == "reduce-scatter" else result
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(op, (n - 1) / n)
        entry = ops.setdefault(op, dict(count=0, payload=0.0, ring=0.0))
        entry["count"] += 1
        entry["payload"] += payload
        entry["ring"] += factor * payload
    return dict(ops=ops, payload_bytes=sum(e["payload"] for e in ops.values()),
                ring_bytes=sum(e["ring"] for e in ops.values()))


def flops_of(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", float("nan")))


def temp_bytes_of(compiled) -> float:
    try:
        return float(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # not every backend/version reports it
        return float("nan")


def per_device_bytes(tree: Any, devices: list) -> list[int]:
    """Bytes of ``tree``'s arrays held on each device (addressable shards)."""
    totals = {d: 0 for d in devices}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            totals[shard.device] += shard.data.nbytes
    return [totals[d] for d in devices]


# ----------------------------------------------------------------------------- load balance

def executed_polar_flops(r: int, c: int, ns_steps: int = 5, method: str = "auto") -> int:
    """Polar FLOPs muon_optax executes on one matrix: the form ``method`` picks for the
    default compute dtype of this backend (float32 on CPU: Gram space for rectangular
    matrices)."""
    dtype = muon_optax.polar.default_compute_dtype()
    chosen = muon_optax.polar.choose_method(r, c, ns_steps, method, dtype)
    return muon_optax.polar.polar_flops(r, c, ns_steps, chosen)


def balance(params: Any, tx: Any, n: int) -> dict[str, Any]:
    """Per-device Muon FLOPs and momentum elements: our stacks vs nanochat's groups.

    Ours counts the FLOPs of the form muon_optax runs (``polar_method="auto"``), each
    relative to its own total; nanochat's the direct form it runs.
    """
    ours_dev = 0.0
    ours_slots_elems = 0
    real = 0.0
    for s in tx.init.stack_info(params, num_devices=n):
        r, c = s["shape"]
        ours_dev += s["padded"] // n * executed_polar_flops(r, c)
        ours_slots_elems += s["padded"] // n * r * c
        real += s["size"] * executed_polar_flops(r, c)
    # nanochat: one group per PyTorch (out, in) shape, no merging of tall and wide.
    d = params["wte"]["embedding"].shape[1]
    n_layer = len(params["blocks"])
    groups: dict[tuple[int, int], int] = {}
    for fan_in, fan_out in block_shapes(d).values():
        groups[(fan_out, fan_in)] = groups.get((fan_out, fan_in), 0) + n_layer
    nano = np.zeros(n)
    nano_slots_elems = 0
    for (r, c), k in groups.items():
        chunk = -(-k // n)
        nano_slots_elems += chunk * r * c
        for dev in range(n):
            nano[dev] += min(chunk, max(0, k - dev * chunk)) * polar_flops(r, c)
    ideal = real / n
    nano_ideal = sum(k * polar_flops(r, c) for (r, c), k in groups.items()) / n
    muon_elems = sum(r * c * k for (r, c), k in groups.items())
    return dict(
        ideal_flops=ideal,
        ours_max_flops=ours_dev, ours_over_ideal=ours_dev / ideal, ours_max_over_mean=1.0,
        nano_max_flops=float(nano.max()), nano_over_ideal=float(nano.max()) / nano_ideal,
        nano_max_over_mean=float(nano.max() / nano.mean()),
        ours_momentum_over_ideal=ours_slots_elems / (muon_elems / n),
        nano_momentum_over_ideal=nano_slots_elems / (muon_elems / n),
        stacks_ours=[(s["padded"], *s["shape"]) for s in tx.init.stack_info(params, n)],
        groups_nano=[(k, r, c) for (r, c), k in groups.items()],
    )


# ----------------------------------------------------------------------------- one N

def measure(n: int, params_np: Any, groups: dict, args) -> dict[str, Any]:
    devices = jax.devices()[:n]
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=devices)
    labels = nanochat_labels(params_np)
    repl = NamedSharding(mesh, P())
    params = jax.device_put(params_np, repl)
    grad_bytes = tree_bytes(params_np)

    # ours: ZeRO-2 under shard_map
    tx = muon_optax.muon_adamw(groups, labels, axis_name="data")
    specs = muon_optax.state_specs(tx, params_np, mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    state_dev = per_device_bytes(state, devices)

    def step(params, state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)  # this device's own gradients
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    sharded_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                         out_specs=(P(), specs)))
    grads_np = random_grads(params_np)
    grads = jax.device_put(jax.tree.map(lambda g: np.stack([g] * n), grads_np),
                           NamedSharding(mesh, P("data")))
    compiled = sharded_step.lower(params, state, grads).compile()
    hlo = compiled.as_text()
    if args.dump_hlo:
        Path(args.dump_hlo).mkdir(parents=True, exist_ok=True)
        Path(args.dump_hlo, f"muon_optax_N{n}.hlo.txt").write_text(hlo)
    coll = collectives(hlo, n)
    finite = None
    if not args.no_run:
        new_params, _ = compiled(params, state, grads)
        finite = bool(all(jnp.isfinite(x).all() for x in jax.tree.leaves(new_params)))

    # optax.contrib.muon: plain jit, everything replicated on the mesh
    txc = optax_contrib_muon(params_np)
    state_c = jax.jit(txc.init, out_shardings=repl)(params)
    grads_r = jax.device_put(grads_np, repl)

    def step_c(params, state, grads):
        updates, state = txc.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    compiled_c = jax.jit(step_c, in_shardings=(repl, repl, repl),
                         out_shardings=(repl, repl)).lower(params, state_c, grads_r).compile()
    coll_c = collectives(compiled_c.as_text(), n)

    plain = None
    if n == 1:  # the unsharded transformation (axis_name=None), for reference
        txp = muon_optax.muon_adamw(groups, labels)

        def step_p(params, state, grads):
            updates, state = txp.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        state_p = jax.jit(txp.init)(params)
        compiled_p = jax.jit(step_p).lower(params, state_p, grads_r).compile()
        plain = dict(flops=flops_of(compiled_p), temp_bytes=temp_bytes_of(compiled_p),
                     collectives=collectives(compiled_p.as_text(), 1),
                     state_bytes=per_device_bytes(state_p, devices))

    return dict(
        n=n, grad_bytes=grad_bytes,
        ours=dict(state_bytes=state_dev, flops=flops_of(compiled), temp_bytes=temp_bytes_of(
            compiled), collectives=coll, finite_after_step=finite),
        contrib=dict(state_bytes=per_device_bytes(state_c, devices), flops=flops_of(compiled_c),
                     temp_bytes=temp_bytes_of(compiled_c), collectives=coll_c,
                     muon_flops_analytic=muon_flops(params_np)),
        plain=plain,
        balance=balance(params_np, tx, n),
    )


def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    params_np = nanochat_params(args.n_embd, args.n_layer, args.vocab, args.dtype)
    groups = nanochat_groups(args.n_embd)
    print(f"# sharded: d{args.n_embd} x {args.n_layer} layers, vocab {args.vocab}, "
          f"{args.dtype}; devices {args.devices} (simulated CPU); jax {jax.__version__}, "
          f"optax {optax.__version__}", flush=True)
    results = []
    for n in args.devices:
        results.append(measure(n, params_np, groups, args))
        r = results[-1]
        print(f"#   N={n}: compiled; step ran finite={r['ours']['finite_after_step']}",
              flush=True)

    base = next((r for r in results if r["n"] == 1), None)
    if base is None:
        raise SystemExit("include N=1 in --devices: it is the total the targets divide")
    total_state = max(base["ours"]["state_bytes"])
    total_flops = base["ours"]["flops"]

    print("\n### Optimizer state per device (MiB; max over devices)\n")
    print("| N | muon_optax | total/N | ratio | target <= 1.1 | optax.contrib (replicated) |")
    print("|---:|---:|---:|---:|:---:|---:|")
    for r in results:
        ours = max(r["ours"]["state_bytes"])
        ideal = total_state / r["n"]
        r["state_ratio"] = ours / ideal
        print(f"| {r['n']} | {ours / MB:.2f} | {ideal / MB:.2f} | {ours / ideal:.3f} | "
              f"{verdict(ours <= TOLERANCE * ideal)} | "
              f"{max(r['contrib']['state_bytes']) / MB:.2f} |")

    print("\n### FLOPs per device per step (GFLOP; compiled.cost_analysis())\n")
    print("| N | muon_optax | N=1 total/N | ratio | target <= 1.1 | Muon executed, analytic/device "
          "| optax.contrib (replicated): cost_analysis / Muon analytic | "
          "temp MiB ours / contrib |")
    print("|---:|---:|---:|---:|:---:|---:|---:|---:|")
    for r in results:
        ours, ideal = r["ours"]["flops"], total_flops / r["n"]
        r["flops_ratio"] = ours / ideal
        print(f"| {r['n']} | {ours / 1e9:.2f} | {ideal / 1e9:.2f} | {ours / ideal:.3f} | "
              f"{verdict(ours <= TOLERANCE * ideal)} | "
              f"{r['balance']['ours_max_flops'] / 1e9:.2f} | "
              f"{r['contrib']['flops'] / 1e9:.2f} / "
              f"{r['contrib']['muon_flops_analytic'] / 1e9:.2f} | "
              f"{r['ours']['temp_bytes'] / MB:.1f} / {r['contrib']['temp_bytes'] / MB:.1f} |")
    plain = base["plain"]
    ops_p = ", ".join(f"{k} {int(v['count'])}" for k, v in
                      sorted(plain["collectives"]["ops"].items())) or "none"
    print(f"\nUnsharded muon_optax (axis_name=None, plain jit): {plain['flops'] / 1e9:.2f} "
          f"GFLOP, temp {plain['temp_bytes'] / MB:.1f} MiB, state "
          f"{max(plain['state_bytes']) / MB:.2f} MiB, collectives: {ops_p}. "
          "optax.contrib's cost_analysis counts the body of its lax.scan over the 5 "
          "coefficient rows once, hence the second (analytic) figure.")

    print("\n### Collectives per step (muon_optax; MiB)\n")
    print("Payload = the full-size buffer of each op (all-reduce/all-gather result, "
          "reduce-scatter operand); ring = bytes each device sends on a ring "
          "((N-1)/N x payload for reduce-scatter and all-gather, 2(N-1)/N x for "
          "all-reduce). Target: one ring all-reduce of the gradients, 2(N-1)/N x grad "
          "bytes.\n")
    print("| N | ops (count) | payload | ring/device | target | ratio | target met | "
          "optax.contrib ops |")
    print("|---:|---|---:|---:|---:|---:|:---:|---|")
    for r in results:
        c, n = r["ours"]["collectives"], r["n"]
        target = 2 * (n - 1) / n * r["grad_bytes"]
        ops = ", ".join(f"{k} {int(v['count'])}" for k, v in sorted(c["ops"].items())) or "none"
        ops_c = ", ".join(f"{k} {int(v['count'])}" for k, v in
                          sorted(r["contrib"]["collectives"]["ops"].items())) or "none"
        ratio = c["ring_bytes"] / target if target else None
        r["collective_ratio"] = ratio
        print(f"| {n} | {ops} | {c['payload_bytes'] / MB:.2f} | {c['ring_bytes'] / MB:.2f} | "
              f"{target / MB:.2f} | {'-' if ratio is None else f'{ratio:.3f}'} | "
              f"{verdict(c['ring_bytes'] <= target * (1 + 1e-9))} | {ops_c} |")

    print("\n### Muon load balance (analytic, executed slots)\n")
    print("ours: every device runs padded/N slots of every stack (tall and wide merged); "
          "nanochat: one stack per PyTorch shape, chunk = ceil(K/N), device d computes "
          "min(chunk, K - d*chunk) real matrices. 'max/ideal' = busiest device over total/N "
          "(the target's measure); 'max/mean' = busiest over average of executed work; "
          "'momentum' = per-device momentum slots over total/N.\n")
    print("| set | N | ours stacks (K,R,C) | ours max/ideal | ours momentum | "
          "nanochat groups (K,R,C) | nanochat max/ideal | nanochat max/mean | "
          "nanochat momentum | target (ours) |")
    print("|---|---:|---|---:|---:|---|---:|---:|---:|:---:|")
    sets = [(args.n_embd, args.n_layer)] + [s for s in args.balance_sets
                                            if s != (args.n_embd, args.n_layer)]
    balance_rows = []
    for d, layers in sets:
        shapes = nanochat_params(d, layers, 256, args.dtype, abstract=True)
        tx = muon_optax.muon_adamw(nanochat_groups(d), nanochat_labels(shapes))
        for n in args.devices:
            b = balance(shapes, tx, n)
            balance_rows.append(dict(set=f"d{d}x{layers}", n=n, **b))
            print(f"| d{d} x {layers} | {n} | {b['stacks_ours']} | {b['ours_over_ideal']:.3f} "
                  f"| {b['ours_momentum_over_ideal']:.3f} | {b['groups_nano']} | "
                  f"{b['nano_over_ideal']:.3f} | {b['nano_max_over_mean']:.3f} | "
                  f"{b['nano_momentum_over_ideal']:.3f} | "
                  f"{verdict(b['ours_over_ideal'] <= TOLERANCE)} |")

    out = dict(config=vars(args), results=results, balance=balance_rows)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
