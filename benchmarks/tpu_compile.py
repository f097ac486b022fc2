"""The optimizer step as the TPU compiler builds it, without a TPU (deviceless AOT).

With ``libtpu`` installed (``pip install -e ".[tpu]"``), ``jax.experimental.topologies``
gives compile-only devices of a TPU slice; a step lowered on ``jax.ShapeDtypeStruct``s
placed on a mesh of them and compiled runs the real TPU compiler. Per chip it reports:
compile time, ``memory_analysis`` (arguments, temporaries, outputs, and the peak: all
three less the outputs aliased to donated arguments), the collectives of the optimized
HLO (count and the bytes each chip sends on a ring; a collective inside a while loop
counted by its trip count), the HLO's size, and FLOPs (muon_optax's from
``estimate``; the others' from ``cost_analysis``, which counts a loop body once).

Contenders (the optimizer's update + ``apply_updates``, float32 params, nanochat's GPT
shapes of ``benchmarks.common.nanochat_params``, vocabulary ``--vocab``):

  one_device      muon_adamw, one chip (no axis_name)
  mesh_1          muon_adamw(axis_name="data", mesh=), one chip
  optax           optax.contrib.muon (common.optax_contrib_args); its state split like
                  the params; the baseline of every ratio
  adamw           optax.adamw (lr 1e-3): the floor
  fsdp            muon_adamw(mesh=) on FSDP params (each leaf split on its first axis
                  divisible by the chips); optax's baseline: optax_fsdp, the same layout
  zero2           muon_adamw(axis_name="data") inside shard_map, params replicated, each
                  chip its own gradient; optax's baseline: optax_dp (gradients pmean-ed
                  in the same shard_map, then optax.contrib.muon)
  heads_tp        a ("data", "model") mesh, attention and MLP kernels split Megatron-style
                  over "model" (2 chips: it divides every set's heads), attention kernels
                  in per-head Muon blocks; optax's baseline: optax_tp (the same layout)

Compile time is the compiling process's CPU time (all its threads; the wall time in
brackets): on a shared machine it varies far less than the wall time. Each compile runs
in a process of its own (a bounded ``--timeout``), so that one long
compile neither holds the others nor shares caches with them. Topologies: ``v5p:1`` (one
chip), ``v5p:8`` (2x2x2), ``v5p:64`` (4x4x4), ``v5e:8`` (2x4), ``v6e:8`` (2x4).

  python benchmarks/tpu_compile.py --sets d256x4 d768x12 --topologies v5p:1 v5p:8
  python benchmarks/tpu_compile.py --table a.json b.json     # one table of saved runs
  python benchmarks/tpu_compile.py --sets d768x12 --topologies v5p:8 --repeat 3  # medians
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")   # quiets libtpu's host probe
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

TOPOLOGIES = {"v5p:1": ("v5p:2x2x1", 1), "v5p:8": ("v5p:2x2x2", 8),
              "v5p:64": ("v5p:4x4x4", 64), "v5e:8": ("v5e:2x4", 8), "v6e:8": ("v6e:2x4", 8)}
HBM = {"v5p": 95 * 2**30, "v5e": 16 * 2**30, "v6e": 32 * 2**30}   # bytes per chip
SINGLE = ("one_device", "mesh_1", "optax", "adamw")
MULTI = ("fsdp", "optax_fsdp", "zero2", "optax_dp", "heads_tp", "optax_tp", "adamw_fsdp")
BASELINE = {"one_device": "optax", "mesh_1": "optax", "fsdp": "optax_fsdp",
            "zero2": "optax_dp", "heads_tp": "optax_tp"}
# The "model" axis of heads_tp: it must divide every set's head count (d256: 2 heads,
# d768: 6, d1280: 10; head_dim 128), or the per-head blocks are cut across chips and
# muon_adamw gathers those kernels whole (with a warning), which is not tensor parallelism.
TP = 2


def topology_devices(name: str) -> list[Any]:
    """Compile-only devices of a TPU topology (``TOPOLOGIES``), as many as it names."""
    from jax.experimental import topologies

    desc, n = TOPOLOGIES[name]
    platform = desc.split(":")[0]
    devices = topologies.get_topology_desc(topology_name=desc, platform="tpu").devices
    assert len(devices) >= n, (platform, len(devices))
    return list(devices)[:n]


# ----------------------------------------------------------------------------- contenders


def _abstract(tree: Any, specs: Any, mesh) -> Any:
    import jax
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                          sharding=NamedSharding(mesh, s)),
                        tree, specs)


def _spec_like_params(state: Any, params: Any, specs: Any) -> Any:
    """Each optax state leaf laid out like the param of its shape (P() otherwise)."""
    import jax
    from jax.sharding import PartitionSpec as P

    by_shape = {tuple(x.shape): s for x, s in zip(jax.tree.leaves(params),
                                                  jax.tree.leaves(specs,
                                                                  is_leaf=lambda s: isinstance(
                                                                      s, P)))}
    return jax.tree.map(lambda x: by_shape.get(tuple(x.shape), P()), state)


def _step(tx):
    import optax

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


def _tp_specs(params: Any) -> Any:
    """Megatron over "model": c_q/c_k/c_v/c_fc split on their outputs (heads), the two
    c_proj on their inputs; everything else replicated."""
    import jax
    from jax.sharding import PartitionSpec as P

    def spec(path, x):
        keys = [str(getattr(k, "key", k)) for k in path]
        if "blocks" not in keys:
            return P()
        return P("model", None) if keys[-2] == "c_proj" else P(None, "model")
    return jax.tree_util.tree_map_with_path(spec, params)


def _head_dims(params: Any, heads: int) -> Any:
    import jax

    import muon_optax

    D = muon_optax.MuonDimensionNumbers

    def dims(path, x):
        keys = [str(getattr(k, "key", k)) for k in path]
        if "attn" not in keys:
            return None
        return D(0, 1, reduction_blocks=heads) if keys[-2] == "c_proj" else D(
            0, 1, output_blocks=heads)
    return jax.tree_util.tree_map_with_path(dims, params)


def build(contender: str, params: Any, devices: list[Any]):
    """``(jitted step, abstract args, tx or None, param specs for estimate)``."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import muon_optax
    from benchmarks import common

    n = len(devices)
    d = params["wte"]["embedding"].shape[1]
    groups, labels = common.nanochat_groups(d), common.nanochat_labels(params)
    if contender in ("heads_tp", "optax_tp"):
        mesh = Mesh(np.array(devices).reshape(n // TP, TP), ("data", "model"),
                    axis_types=(AxisType.Auto,) * 2)
        specs = _tp_specs(params)
    else:
        mesh = Mesh(np.array(devices), ("data",), axis_types=(AxisType.Auto,))
        fsdp = contender in ("fsdp", "optax_fsdp", "adamw_fsdp")
        specs = jax.tree.map(lambda x: common.fsdp_spec(x.shape, n) if fsdp else P(), params)
    p_abs = _abstract(params, specs, mesh)

    if contender == "zero2":
        tx = muon_optax.muon_adamw(groups, labels, axis_name="data")
        state_specs = muon_optax.state_specs(tx, params, mesh)
        s_abs = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(),
                                             out_specs=state_specs), p_abs)
        s_abs = _abstract(s_abs, state_specs, mesh)
        g_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            (n,) + x.shape, x.dtype, sharding=NamedSharding(mesh, P("data"))), params)

        def step(p, s, g):
            u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return optax.apply_updates(p, u), s
        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), state_specs, P("data")),
                                   out_specs=(P(), state_specs)), donate_argnums=(0, 1))
        return fn, (p_abs, s_abs, g_abs), tx, None

    if contender == "optax_dp":
        tx = common.optax_contrib_muon(params)
        s_abs = jax.eval_shape(tx.init, params)
        s_specs = jax.tree.map(lambda _: P(), s_abs)
        s_abs = _abstract(s_abs, s_specs, mesh)
        g_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            (n,) + x.shape, x.dtype, sharding=NamedSharding(mesh, P("data"))), params)

        def step(p, s, g):
            g = jax.lax.pmean(jax.tree.map(lambda x: x[0], g), "data")
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), s_specs, P("data")),
                                   out_specs=(P(), s_specs)), donate_argnums=(0, 1))
        return fn, (p_abs, s_abs, g_abs), None, None

    dims = None
    if contender in ("one_device",):
        tx = muon_optax.muon_adamw(groups, labels)
    elif contender in ("mesh_1", "fsdp", "heads_tp"):
        if contender == "heads_tp":
            dims = _head_dims(params, d // 128 if d >= 512 else d // 64)
        axis = "model" if contender == "heads_tp" else "data"   # heads: owners over "model"
        tx = muon_optax.muon_adamw(groups, labels, axis_name=axis, mesh=mesh,
                                   param_specs=specs, dimension_numbers=dims)
    elif contender.startswith("optax"):
        tx = common.optax_contrib_muon(params)
    else:   # adamw, adamw_fsdp
        tx = optax.adamw(1e-3)
    if hasattr(tx.init, "state_specs"):
        s_specs = muon_optax.state_specs(tx, params, mesh) if contender != "one_device" else \
            jax.tree.map(lambda _: P(), jax.eval_shape(tx.init, params))
    else:
        s_specs = _spec_like_params(jax.eval_shape(tx.init, params), params, specs)
    s_abs = _abstract(jax.eval_shape(tx.init, params), s_specs, mesh)
    fn = jax.jit(_step(tx), out_shardings=(jax.tree.map(lambda s: NamedSharding(mesh, s), specs),
                                           jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                        s_specs)),
                 donate_argnums=(0, 1))
    muon_tx = tx if hasattr(tx.init, "state_specs") else None
    return fn, (p_abs, s_abs, p_abs), muon_tx, (specs if contender != "one_device" else None)


# ----------------------------------------------------------------------------- HLO reading

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CALLS = re.compile(r"(body|condition|calls|to_apply|true_computation|false_computation)="
                    r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def computation_multiplicity(hlo: str) -> dict[str, int]:
    """How many times each computation of an HLO module runs per call of the entry: a
    while body by its known trip count, a conditional's branches once each (the most any
    one runs)."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        trip = _TRIP.search(line)
        for kind, callee in _CALLS.findall(line):
            calls[current].append((callee, int(trip.group(1)) if trip and kind == "body"
                                   else 1))
        for group in _BRANCHES.findall(line):
            for callee in group.split(","):
                calls[current].append((callee.strip().lstrip("%"), 1))
    times: dict[str, int] = defaultdict(int)

    def visit(name: str, k: int) -> None:
        times[name] += k
        for callee, trip in calls.get(name, ()):
            visit(callee, k * trip)
    if entry:
        visit(entry, 1)
    return times


def loop_collectives(hlo: str, n: int) -> dict[str, dict[str, float]]:
    """:func:`common.collectives` per computation, each times its multiplicity."""
    from benchmarks import common

    times = computation_multiplicity(hlo)
    blocks: dict[str, list[str]] = defaultdict(list)
    current = None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
        elif current:
            blocks[current].append(line)
    total: dict[str, dict[str, float]] = {}
    chains: set = set()
    for name, lines in blocks.items():
        k = times.get(name, 0)
        for op, v in common.collectives("\n".join(lines), n, chains).items():
            entry = total.setdefault(op, dict(count=0, bytes=0, ring=0.0))
            for key in entry:
                entry[key] += k * v[key]
    return total


# ----------------------------------------------------------------------------- one compile


def compile_one(contender: str, set_name: str, topology: str, vocab: int) -> dict[str, Any]:
    """Compiles one contender for one set and topology (in this process)."""
    import muon_optax
    from benchmarks import common

    width, layers = common.parse_set(set_name)
    params = common.nanochat_params(width, layers, vocab, abstract=True)
    devices = topology_devices(topology)
    fn, args, tx, specs = build(contender, params, devices)
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    ops = loop_collectives(hlo, len(devices))
    row = dict(contender=contender, set=set_name, topology=topology, lower_s=t1 - t0,
               compile_s=t2 - t1, compile_cpu_s=c2 - c1, args=int(mem.argument_size_in_bytes),
               temp=int(mem.temp_size_in_bytes), out=int(mem.output_size_in_bytes),
               alias=int(mem.alias_size_in_bytes), hlo_lines=hlo.count("\n"),
               whiles=len(re.findall(r"\bwhile\(", hlo)),
               dots=len(re.findall(r"\b(?:dot|convolution)\(", hlo)),
               collectives={k: dict(count=v["count"], ring=v["ring"]) for k, v in ops.items()},
               ring=sum(v["ring"] for v in ops.values()),
               flops_cost=common.cost_flops(compiled))
    if tx is not None:
        if contender == "one_device":   # estimate plans a device count: one
            d = params["wte"]["embedding"].shape[1]
            tx = muon_optax.muon_adamw(common.nanochat_groups(d), common.nanochat_labels(params),
                                       axis_name="data")
        owners = TP if contender == "heads_tp" else len(devices)
        est = muon_optax.estimate(tx, params, owners, param_specs=specs)
        row["flops_estimate"] = float(est["program_flops"])
    return row


def run_child(contender: str, set_name: str, topology: str, vocab: int,
              timeout: float) -> dict[str, Any]:
    """:func:`compile_one` in a fresh process, at most ``timeout`` seconds."""
    cmd = [sys.executable, "-m", "benchmarks.tpu_compile", "--child", contender, set_name,
           topology, "--vocab", str(vocab)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    except subprocess.TimeoutExpired:
        return dict(contender=contender, set=set_name, topology=topology,
                    error=f"compile over {timeout:.0f} s")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return dict(contender=contender, set=set_name, topology=topology,
                    error=" / ".join(tail)[-300:])
    return json.loads(lines[-1])


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of ``--repeat`` compiles of a program: its median compile times (CPU and
    wall; every CPU time kept), or the first error."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    row = dict(runs[0])
    for key in ("compile_cpu_s", "compile_s"):
        row[key] = statistics.median(r[key] for r in runs)
    row["compile_cpu_all"] = [round(r["compile_cpu_s"], 2) for r in runs]
    return row


# ----------------------------------------------------------------------------- tables

MB = 2**20


def table(rows: list[dict[str, Any]]) -> str:
    from benchmarks import common

    by_key = {(r["set"], r["topology"], r["contender"]): r for r in rows}
    out = []
    for r in rows:
        base = by_key.get((r["set"], r["topology"], BASELINE.get(r["contender"], "")))
        if "error" in r:
            out.append([r["set"], r["topology"], r["contender"], r["error"]] + [""] * 11)
            continue
        ops = ", ".join(f"{v['count']} {k}" for k, v in sorted(r["collectives"].items()))
        for row in (r, base):   # peak: arguments, temporaries and the outputs not aliased
            if row is not None and "error" not in row:
                row["peak"] = row["args"] + row["temp"] + row["out"] - row.get("alias", 0)

        def ratio(key, base=base, r=r):
            if base is None or "error" in base or not base[key]:
                return "-"
            return f"{r[key] / base[key]:.2f}"
        flops = r.get("flops_estimate", r["flops_cost"])
        out.append([r["set"], r["topology"], r["contender"],
                    f"{r['compile_cpu_s']:.1f} ({r['compile_s']:.1f})", ratio("compile_cpu_s"),
                    f"{r['args'] / MB:.1f}", f"{r['temp'] / MB:.1f}",
                    ratio("temp"), f"{r['out'] / MB:.1f}", f"{r['peak'] / MB:.1f}",
                    ratio("peak"), ops or "none",
                    f"{r['ring'] / MB:.1f}", ratio("ring") if r["ring"] else "-",
                    f"{r['hlo_lines']} / {r['dots']} / {r['whiles']}",
                    common.fmt(flops / 1e9, ".1f")])
    return common.md_table(
        ["set", "topology", "contender", "compile CPU s (wall)", "x base", "args MiB", "temp MiB",
         "x base", "out MiB", "peak MiB", "x base", "collectives", "ring MiB/chip", "x base",
         "HLO lines / dots / whiles", "GFLOP"], out, "lllrrrrrrrrlrrrr")


def main(argv=None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["d256x4", "d768x12"])
    ap.add_argument("--topologies", nargs="+", default=["v5p:1", "v5p:8"],
                    choices=sorted(TOPOLOGIES))
    ap.add_argument("--contenders", nargs="+", default=None,
                    help="default: every contender that fits the topology")
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per compile")
    ap.add_argument("--repeat", type=int, default=1,
                    help="compile each program this many times, the contenders of a set and "
                         "topology in turn each round; report the median compile times")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--table", nargs="+", metavar="JSON",
                    help="compile nothing: print one table of the rows of these --json files "
                         "(runs of other contenders, sets or topologies, joined)")
    ap.add_argument("--child", nargs=3, metavar=("CONTENDER", "SET", "TOPOLOGY"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(compile_one(*args.child, args.vocab)))
        return []
    if args.table:
        rows = []
        for path in args.table:
            with open(path) as f:
                rows += json.load(f)
        print(table(rows))
        return rows
    import jax

    rows = []
    print(f"# TPU compiler (deviceless AOT), jax {jax.__version__}; vocab {args.vocab}; "
          f"{os.cpu_count()} CPUs\n", flush=True)
    for set_name in args.sets:
        for topo in args.topologies:
            n = TOPOLOGIES[topo][1]
            names = [c for c in args.contenders or (SINGLE if n == 1 else MULTI)
                     if (n == 1) == (c in SINGLE)]
            runs: dict[str, list] = {c: [] for c in names}
            for _ in range(args.repeat):   # rounds: drift of the machine hits every contender
                for c in names:
                    runs[c].append(run_child(c, set_name, topo, args.vocab, args.timeout))
                    print(json.dumps(runs[c][-1]), file=sys.stderr, flush=True)
            rows += [median_row(runs[c]) for c in names]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    hbm = {t: HBM[t.split(":")[0]] for t in args.topologies}
    print(f"\nHBM per chip: {', '.join(f'{t} {v / 2**30:.0f} GiB' for t, v in hbm.items())}")
    return rows


if __name__ == "__main__":
    main()
