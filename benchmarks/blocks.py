"""Muon on per-head blocks against whole matrices: FLOPs, time, and sharded traffic.

**One device** (each set of ``--sets``, nanochat-like params, heads of ``--head-dim``):
``whole`` is nanochat's rule (every kernel one matrix); ``heads`` cuts the attention
kernels into per-head blocks (``c_q``, ``c_k``, ``c_v``: ``output_blocks=heads``;
``c_proj``: ``reduction_blocks=heads``), the MLP whole. For each: the compiled update's
FLOPs (``cost_analysis``), the Muon phase's FLOPs from the plan's cost model (the polar
iteration in its direct form: a ``d x d`` matrix ~``d^3``, ``H`` blocks of ``d/H x d``
~``d^3 / H``, split into attention and MLP), temporaries, and the median time of the
jitted ``update`` + ``apply_updates`` (``--reps`` interleaved rounds; the ratio is the
median of per-rep ratios).

**Head-parallel** (8 simulated CPU devices, a ``("model",)`` mesh, the ``mesh=`` form):
the attention kernels of each set split over ``"model"`` on their heads (``c_q``/``c_k``
/``c_v`` on the output side, ``c_proj`` on the input side: Megatron's column- and
row-parallel layout), ``heads`` a multiple of 8. Per device, from the compiled optimizer
step: collectives (bytes each device sends on a ring), FLOPs and temporaries, for whole
matrices (moved to owners by two all-to-alls) and per-head blocks (each device owns the
blocks it holds: nothing moves).

  PYTHONPATH=. python benchmarks/blocks.py                    # d256x4, d512x4 (~3 min)
  PYTHONPATH=. python benchmarks/blocks.py --quick            # d64x2, 2 reps
"""

from __future__ import annotations

import os

N = 8
_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={N}".strip()

import statistics  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import muon_optax  # noqa: E402
from benchmarks import common  # noqa: E402
from muon_optax import MuonDimensionNumbers as D  # noqa: E402
from muon_optax.plan.plan import matrix_flops  # noqa: E402

ATTENTION_OUT = ("c_q", "c_k", "c_v")     # (d, heads * head_dim): heads on the output side


def head_dims(params: Any, heads: int | None) -> Any:
    """Per-head blocks of the attention kernels (None: every kernel whole)."""
    def dims(path, x):
        keys = [str(getattr(k, "key", k)) for k in path]
        if heads is None or "attn" not in keys or x.ndim != 2:
            return None
        return (D(0, 1, output_blocks=heads) if keys[-2] in ATTENTION_OUT
                else D(0, 1, reduction_blocks=heads))
    return jax.tree_util.tree_map_with_path(dims, params)


def make_tx(params: Any, width: int, heads: int | None, **kw) -> optax.GradientTransformation:
    return muon_optax.muon_adamw(common.nanochat_groups(width), common.nanochat_labels,
                                 dimension_numbers=head_dims(params, heads), **kw)


def muon_flops_by_part(tx, params) -> dict[str, float]:
    """The plan's Muon FLOPs (cost model, one device) of the attention and MLP kernels."""
    plan = tx.init.plan(params)
    out = {"attn": 0.0, "mlp": 0.0}
    for sp in plan.owner.stacks:
        for m in sp.stack.members:
            out["attn" if "/attn/" in m.path else "mlp"] += m.batch * matrix_flops(sp.stack)
    return out


def step_fn(tx):
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step


def one_device(width: int, layers: int, head_dim: int, vocab: int, reps: int) -> dict:
    heads = width // head_dim
    params = jax.tree.map(jnp.asarray, common.nanochat_params(width, layers, vocab))
    grads = jax.tree.map(jnp.asarray, common.random_grads(params))
    rows, calls = {}, {}
    for name, h in (("whole", None), ("heads", heads)):
        tx = make_tx(params, width, h)
        state = tx.init(params)
        compiled = jax.jit(step_fn(tx)).lower(params, state, grads).compile()
        out = compiled(params, state, grads)
        finite = all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(out[0]))
        calls[name] = (lambda c=compiled, s=state: jax.block_until_ready(c(params, s, grads)))
        rows[name] = dict(flops=common.cost_flops(compiled), muon=muon_flops_by_part(tx, params),
                          temp=common.memory_of(compiled)["temp"], finite=finite)
    for call in calls.values():   # warm
        call()
    times = common.time_interleaved(calls, reps)
    for name in rows:
        rows[name]["median_s"] = statistics.median(times[name])
    return dict(set=f"d{width}x{layers}", heads=heads, rows=rows,
                ratio=common.ratio_stats(times["heads"], times["whole"]))


def head_parallel(width: int, layers: int, head_dim: int) -> dict:
    """The attention kernels alone, split on their heads over N devices."""
    heads = width // head_dim
    if heads % N:
        raise ValueError(f"d{width}: {heads} heads do not split over {N} devices")
    full = common.nanochat_params(width, layers, 256)
    params = {"blocks": {i: {"attn": b["attn"]} for i, b in full["blocks"].items()}}
    mesh = jax.make_mesh((N,), ("model",), axis_types=(AxisType.Explicit,))

    def spec(path, _):
        return P(None, "model") if str(path[-2].key) in ATTENTION_OUT else P("model", None)
    specs = jax.tree_util.tree_map_with_path(spec, params)
    placed = jax.tree.map(lambda x, s: jax.device_put(jnp.asarray(x), NamedSharding(mesh, s)),
                          params, specs)
    groups = {"matrix": common.nanochat_groups(width)["matrix"]}
    rows = {}
    for name, h in (("whole", None), ("heads", heads)):
        tx = muon_optax.muon_adamw(groups, lambda p: jax.tree.map(lambda _: "matrix", p),
                                   dimension_numbers=head_dims(params, h), axis_name="model",
                                   mesh=mesh)
        state = jax.jit(tx.init)(placed)
        compiled = jax.jit(step_fn(tx)).lower(placed, state, placed).compile()
        ops = common.collectives(compiled.as_text(), N)
        rows[name] = dict(
            collectives={k: v["ring"] for k, v in ops.items()},
            sent=sum(v["ring"] for v in ops.values()), flops=common.cost_flops(compiled),
            temp=common.memory_of(compiled)["temp"],
            transports=sorted({s["transport"] for s in tx.init.stack_info(placed)}))
    muon_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    return dict(set=f"d{width}x{layers}", heads=heads, muon_bytes=muon_bytes, rows=rows)


def print_tables(results: list[dict], sharded: list[dict]) -> None:
    print(common.md_table(
        ["set", "heads", "matrices", "step FLOPs", "Muon FLOPs attn / MLP (model)",
         "temporaries MiB", "median ms", "heads / whole"],
        [[r["set"], r["heads"], name, f"{row['flops'] / 1e9:.3f} G",
          f"{row['muon']['attn'] / 1e9:.3f} / {row['muon']['mlp'] / 1e9:.3f} G",
          f"{row['temp'] / 2**20:.1f}", f"{row['median_s'] * 1e3:.1f}",
          (f"{r['ratio']['median']:.3f} [{r['ratio']['min']:.2f}, {r['ratio']['max']:.2f}]"
           if name == "heads" else "")]
         for r in results for name, row in r["rows"].items()], "llrrrrrr"))
    print()
    print(common.md_table(
        ["set (attention only)", "heads", "matrices", "transport", "collectives: bytes sent",
         "FLOPs / device", "temporaries MiB"],
        [[r["set"], r["heads"], name, ", ".join(row["transports"]),
          ", ".join(f"{k} {v / 2**20:.3f} MiB" for k, v in row["collectives"].items()) or "0",
          f"{row['flops'] / 1e9:.3f} G", f"{row['temp'] / 2**20:.2f}"]
         for r in sharded for name, row in r["rows"].items()], "llllrrr"))


def main(argv=None) -> None:
    ap = common.base_parser(__doc__)
    ap.add_argument("--sets", nargs="+", default=["d256x4", "d512x4"],
                    help="nanochat-like sets d<width>x<layers>")
    ap.add_argument("--head-dim", type=int, default=64, help="channels per head")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if args.quick:
        args.sets, args.reps, args.vocab, args.head_dim = ["d64x2"], 2, 256, 8
    print(common.machine_line())
    results, sharded = [], []
    for name in args.sets:
        width, layers = common.parse_set(name)
        results.append(one_device(width, layers, args.head_dim, args.vocab, args.reps))
        if (width // args.head_dim) % N == 0:
            sharded.append(head_parallel(width, layers, args.head_dim))
    print_tables(results, sharded)
    common.write_json(args.json, dict(machine=common.machine_line(), one_device=results,
                                      head_parallel=sharded))


if __name__ == "__main__":
    main()
