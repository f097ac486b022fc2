"""What a sharded step costs per device, and how evenly the Muon work is spread.

**Costs** (8 simulated CPU devices, one ``("data",)`` mesh of ``AxisType.Auto``), for each
nanochat-like set of ``--sets``, every contender compiled and run side by side:

  optax_contrib_fsdp  optax.contrib.muon (``common.optax_contrib_args``) under plain jit;
                      params, grads and state FSDP-sharded (each leaf split along its
                      first axis divisible by N, replicated otherwise); GSPMD partitions
                      its Newton-Schulz matmuls. The baseline of every ratio.
  muon_optax_fsdp     muon_adamw(axis_name="data", mesh=mesh, param_specs=FSDP specs), fed
                      the same FSDP params and grads (state as muon_optax.state_specs lays
                      it out): matrices to their owners and back by all-to-all.
  contrib_muon_fsdp   muon_optax.contrib_muon with exactly optax_contrib_fsdp's arguments
                      (and mesh=, param_specs=), same shardings.
  muon_optax          ZeRO-2 inside shard_map, the WHOLE train step: a stand-in model's loss
                      (embedding -> each block's matrices as a residual MLP -> head,
                      cross-entropy on random tokens), jax.grad at
                      jax.lax.pcast(params, "data", to="varying") so that each device keeps
                      its own gradient (no all-reduce), then the optimizer's reduce-scatter
                      and all-gather.
  muon_optax_jit      muon_adamw(axis_name="data", mesh=mesh), params replicated, the whole
                      train step under plain jit: XLA's own all-reduce of the gradients shows
                      in its collectives, beside the optimizer's all-gather.

The first three time the optimizer step alone (update + apply, gradients given); the last
two a whole train step (``--tokens`` per device): their FLOPs, temporaries and time include
the model's forward and backward pass (about 6 x params x tokens FLOPs, printed).

Per device: resident bytes (params + grads + state, max over devices; a train step's
gradients are laid out like its params), state bytes, FLOPs (``cost_analysis``),
temporaries (``memory_analysis``), the collectives of the HLO with the bytes each device
sends on a ring, and the median step time (``--reps`` interleaved rounds; ratios are
medians of per-rep ratios). Ratios against optax_contrib_fsdp, with issue targets:
collective bytes <= 1/20, FLOPs <= 0.8, temporaries <= 0.5, step time <= 0.7; resident
bytes <= 1.1 x (the contender's global params + grads + state) / N, plus the params that
no axis of which N divides (x 4: param, grad, two moments).

optax's Polar Express is a ``lax.scan`` over the coefficient table, whose body XLA's cost
analysis and the HLO text count once. optax_contrib_fsdp's FLOPs and collectives are
therefore read from a twin built with one Polar Express triple (optax runs a triple in a
``fori_loop`` that it unrolls): the same matmuls and collectives, 5 times written out.
Its temporaries and step time are the real (scanned) program's.

``muon_optax.estimate``'s numbers stand beside the measured ones for our contenders; the
state bytes must agree exactly (printed: "equal").

**Balance** (no devices: ``muon_optax.estimate`` and the plan's cost model,
``muon_optax.plan.plan.matrix_flops``): nanochat d12, d20, d26, d32 (width 64 x depth, block
matrices only) at N = 8 ... 256, the busiest device's Muon FLOPs and Muon state over the
exact whole-matrix optimum (``common.exact_optimum``), for muon_optax's owner plan, per-
stack padding (each device ``ceil(K/N)`` slots of every stack) and nanochat's per-group
chunks (a group per PyTorch shape, chunks of ``ceil(K/N)``).

  PYTHONPATH=. python benchmarks/sharded.py                   # d256x4, d512x8: 15-20 min on 2 cores
  PYTHONPATH=. python benchmarks/sharded.py --only balance    # the balance tables (15 s)
  PYTHONPATH=. python benchmarks/sharded.py --quick           # d64x2, vocab 256, 2 reps (1 min)
"""

from __future__ import annotations

import os

N = 8
_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={N}".strip()

import dataclasses  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import muon_optax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import MB, fmt, md_table  # noqa: E402

BASE = "optax_contrib_fsdp"
TARGETS = dict(ring=1 / 20, flops=0.8, temp=0.5, time=0.7, resident=1.1)


@dataclasses.dataclass
class Problem:
    """What every contender builds its step from (NumPy arrays, FSDP specs)."""
    mesh: jax.sharding.Mesh
    params: Any
    grads: Any
    specs: Any            # FSDP PartitionSpec per param leaf
    tokens: np.ndarray    # (N * batch, T + 1) int32, split over "data" by rows


@dataclasses.dataclass
class Case:
    """One contender's jitted step on the mesh, its arguments, what it covers."""
    step: Callable
    args: tuple           # (params, state, grads or tokens), placed
    scope: str            # "optimizer" or "train step"
    tx: Any = None        # muon_optax's, for the estimate
    est_specs: Any = None
    twin: tuple | None = None  # (step, args) counted in place of step's FLOPs, collectives


def _place(tree: Any, specs: Any, mesh) -> Any:
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def _optimizer_step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


def _fsdp_case(m: Problem, tx, twin_tx=None) -> Case:
    """An optimizer step under plain jit on FSDP params and grads; the state split like
    the params (optax's) or as muon_optax.state_specs says (ours)."""
    params, grads = _place(m.params, m.specs, m.mesh), _place(m.grads, m.specs, m.mesh)

    def build(tx):
        if hasattr(tx.init, "state_specs"):    # muon_optax's own layout of its state
            specs = muon_optax.state_specs(tx, m.params, m.mesh)
        else:
            specs = jax.tree.map(lambda s: common.fsdp_spec(s.shape, m.mesh.size),
                                 jax.eval_shape(tx.init, params))
        state_shardings = jax.tree.map(lambda s: NamedSharding(m.mesh, s), specs)
        state = jax.jit(tx.init, out_shardings=state_shardings)(params)
        outs = (jax.tree.map(lambda s: NamedSharding(m.mesh, s), m.specs), state_shardings)
        return jax.jit(_optimizer_step(tx), out_shardings=outs), (params, state, grads)

    return Case(*build(tx), "optimizer", twin=twin_tx and build(twin_tx))


def optax_contrib_fsdp(m: Problem) -> Case:
    row = tuple(muon_optax.POLAR_EXPRESS_COEFFS[0])   # a triple: unrolled, counted 5 times
    return _fsdp_case(m, common.optax_contrib_muon(m.params),
                      common.optax_contrib_muon(m.params, ns_coeffs=row))


def muon_optax_fsdp(m: Problem) -> Case:
    d = m.params["wte"]["embedding"].shape[1]
    tx = muon_optax.muon_adamw(common.nanochat_groups(d), common.nanochat_labels(m.params),
                               axis_name="data", mesh=m.mesh, param_specs=m.specs)
    return dataclasses.replace(_fsdp_case(m, tx), tx=tx, est_specs=m.specs)


def contrib_muon_fsdp(m: Problem) -> Case:
    tx = muon_optax.contrib_muon(**common.optax_contrib_args(m.params), axis_name="data",
                                 mesh=m.mesh, param_specs=m.specs)
    return dataclasses.replace(_fsdp_case(m, tx), tx=tx, est_specs=m.specs)


def _rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


def model_loss(params: Any, tokens: jax.Array) -> jax.Array:
    """A stand-in model over the param set: embedding -> per block ``x = r x + l x0``, a
    gated mix of c_q/c_k/c_v through c_proj, a squared-ReLU MLP -> head; next-token
    cross-entropy."""
    x0 = params["wte"]["embedding"][tokens[:, :-1]]
    x = x0
    for i in sorted(params["blocks"]):
        a, f = params["blocks"][i]["attn"], params["blocks"][i]["mlp"]
        x = params["resid_lambdas"][i] * x + params["x0_lambdas"][i] * x0
        h = _rms_norm(x)
        mix = jnp.tanh(h @ a["c_q"]["kernel"]) * (h @ a["c_k"]["kernel"]) + h @ a["c_v"]["kernel"]
        x = x + mix @ a["c_proj"]["kernel"]
        x = x + jnp.square(jax.nn.relu(_rms_norm(x) @ f["c_fc"]["kernel"])) @ f["c_proj"]["kernel"]
    logits = _rms_norm(x) @ params["lm_head"]["kernel"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def muon_optax_zero2(m: Problem) -> Case:
    d = m.params["wte"]["embedding"].shape[1]
    tx = muon_optax.muon_adamw(common.nanochat_groups(d), common.nanochat_labels(m.params),
                               axis_name="data")
    specs = muon_optax.state_specs(tx, m.params, m.mesh)
    params = jax.device_put(m.params, NamedSharding(m.mesh, P()))
    state = jax.jit(jax.shard_map(tx.init, mesh=m.mesh, in_specs=P(), out_specs=specs))(params)

    def step(p, s, tokens):
        # pcast: each device differentiates at its own copy, so jax.grad returns its own
        # gradient instead of psum-ing it (the optimizer reduce-scatters it instead).
        loss, g = jax.value_and_grad(model_loss)(jax.lax.pcast(p, "data", to="varying"), tokens)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s, jax.lax.pmean(loss, "data")

    fn = jax.jit(jax.shard_map(step, mesh=m.mesh, in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs, P())))
    tokens = jax.device_put(m.tokens, NamedSharding(m.mesh, P("data")))
    return Case(fn, (params, state, tokens), "train step", tx=tx)


def muon_optax_jit(m: Problem) -> Case:
    d = m.params["wte"]["embedding"].shape[1]
    tx = muon_optax.muon_adamw(common.nanochat_groups(d), common.nanochat_labels(m.params),
                               axis_name="data", mesh=m.mesh, param_specs=P())
    repl = NamedSharding(m.mesh, P())
    params = jax.device_put(m.params, repl)

    def step(p, s, tokens):
        loss, g = jax.value_and_grad(model_loss)(p, tokens)   # XLA all-reduces g
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    tokens = jax.device_put(m.tokens, NamedSharding(m.mesh, P("data")))
    return Case(jax.jit(step, out_shardings=(repl, None, repl)),
                (params, jax.jit(tx.init)(params), tokens), "train step", tx=tx)


CONTENDERS: dict[str, Callable[[Problem], Case]] = {
    BASE: optax_contrib_fsdp, "muon_optax_fsdp": muon_optax_fsdp,
    "contrib_muon_fsdp": contrib_muon_fsdp, "muon_optax": muon_optax_zero2,
    "muon_optax_jit": muon_optax_jit}


def parse_args(argv=None):
    ap = common.base_parser(__doc__)
    ap.add_argument("--sets", default="d256x4,d512x8",
                    help="comma-separated parameter sets d<width>x<layers> (default d256x4,d512x8)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated subset of {','.join(CONTENDERS)} (default: all)")
    ap.add_argument("--reps", type=int, default=10, help="timed rounds (default 10; 0: none)")
    ap.add_argument("--tokens", type=int, default=64,
                    help="tokens per device of the train-step contenders (default 64)")
    ap.add_argument("--only", choices=("costs", "balance"), help="one part only")
    ap.add_argument("--depths", default="12,20,26,32", help="balance: nanochat depths")
    ap.add_argument("--balance-devices", default="8,16,32,64,128,256",
                    help="balance: device counts")
    args = ap.parse_args(argv)
    if args.quick:
        args.sets, args.vocab, args.reps, args.tokens = "d64x2", 256, 2, 16
        args.depths, args.balance_devices = "12,20", "8,64"
    args.sets = [common.parse_set(s) for s in args.sets.split(",") if s]
    args.contenders = [c for c in args.contenders.split(",") if c]
    args.depths = [int(x) for x in args.depths.split(",") if x]
    args.balance_devices = [int(x) for x in args.balance_devices.split(",") if x]
    if set(args.contenders) - set(CONTENDERS):
        ap.error(f"unknown contenders; choose from {list(CONTENDERS)}")
    if args.only != "balance" and len(jax.devices()) < N:
        ap.error(f"needs {N} devices, found {len(jax.devices())} (XLA_FLAGS="
                 f"{os.environ['XLA_FLAGS']!r})")
    return args


# ----------------------------------------------------------------------------- costs

def measure(case: Case, mesh) -> tuple[dict[str, Any], Callable[[], Any]]:
    """Per-device bytes, FLOPs, temporaries and collectives of one compiled step, and a
    call that runs it (waited for)."""
    devices = list(mesh.devices.flat)
    compiled = case.step.lower(*case.args).compile()
    counted = case.twin[0].lower(*case.twin[1]).compile() if case.twin else compiled
    params, state, grads = (common.per_device_bytes(t, devices) for t in (
        case.args[0], case.args[1], case.args[2] if case.scope == "optimizer" else case.args[0]))
    out = dict(scope=case.scope, resident=max(map(sum, zip(params, state, grads))),
               state=max(state), flops=common.cost_flops(counted),
               temp=common.memory_of(compiled)["temp"],
               collectives=common.collectives(counted.as_text(), mesh.size),
               whole=2 * common.tree_bytes(case.args[0]) + common.tree_bytes(case.args[1]))
    out["ring"] = sum(op["ring"] for op in out["collectives"].values())
    if case.twin:
        out["temp_unrolled"] = common.memory_of(counted)["temp"]
    first = compiled(*case.args)
    out["finite"] = bool(all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(first[0])))
    return out, lambda: jax.block_until_ready(compiled(*case.args))


def estimate_row(case: Case, params: Any, n: int) -> dict[str, Any]:
    est = muon_optax.estimate(case.tx, params, n, param_specs=case.est_specs)
    return dict(state=max(est["state_bytes"]), ring=max(est["collective_bytes"]),
                flops=est["program_flops"], muon_flops=max(est["muon_flops"]))


def ratios(row: dict[str, Any], base: dict[str, Any], small: int, n: int) -> dict[str, Any]:
    """Each ratio against the baseline, the resident ratio, and pass/fail per target."""
    r = {k: row[k] / base[k] if base[k] else math.nan for k in ("ring", "flops", "temp")}
    r["time"] = row.get("time_ratio", math.nan)
    r["resident"] = row["resident"] / (row["whole"] / n)
    passed = {k: bool(r[k] <= TARGETS[k]) for k in ("ring", "flops", "temp", "time")}
    passed["resident"] = row["resident"] <= TARGETS["resident"] * row["whole"] / n + small
    return dict(ratio=r, passed=passed)


def cost_set(args, width: int, layers: int) -> dict[str, Any]:
    """Every contender on one parameter set: measured, timed, compared."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:N])
    params = common.nanochat_params(width, layers, args.vocab, args.dtype)
    specs = jax.tree.map(lambda x: common.fsdp_spec(x.shape, N), params)
    tokens = np.random.default_rng(2).integers(0, args.vocab, (N, args.tokens + 1), np.int32)
    m = Problem(mesh, params, common.random_grads(params), specs, tokens)
    rows, calls, est = {}, {}, {}
    for name in args.contenders:
        case = CONTENDERS[name](m)
        rows[name], calls[name] = measure(case, mesh)
        if case.tx is not None:
            est[name] = estimate_row(case, params, N)
        print(f"#   {name}: compiled; step finite: {rows[name]['finite']}", flush=True)
    if args.reps:
        times = common.time_interleaved(calls, args.reps)
        for name, t in times.items():
            rows[name]["median_s"] = statistics.median(t)
            if BASE in times:
                rows[name]["time_ratio"] = common.ratio_stats(t, times[BASE])["median"]
    small = 4 * sum(x.nbytes for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(specs))
                    if all(a is None for a in s))
    for row in rows.values():
        if BASE in rows:
            row.update(ratios(row, rows[BASE], small, N))
    model = 6 * args.tokens * sum(x.size for x in jax.tree.leaves(params["blocks"]))
    model += 6 * args.tokens * params["lm_head"]["kernel"].size
    print_costs(f"d{width}x{layers}", rows, est, model)
    return dict(set=f"d{width}x{layers}", rows=rows, estimate=est, small_params=small,
                model_flops=model)


def print_costs(name: str, rows: dict[str, Any], est: dict[str, Any], model: int) -> None:
    print(f"\n{name}, N = {N}: per device. Train steps include the model (about "
          f"{model / 1e9:.2f} GFLOP per device for {name}'s matrices and head).\n")
    print(md_table(["contender", "scope", "resident MiB", "state MiB", "GFLOP", "temp MiB",
                    "collectives (count)", "ring MiB", "median ms"],
                   [[n, r["scope"], fmt(r["resident"] / MB), fmt(r["state"] / MB),
                     fmt(r["flops"] / 1e9), fmt(r["temp"] / MB, ".1f"),
                     ", ".join(f"{k} {v['count']}" for k, v in sorted(r["collectives"].items()))
                     or "none", fmt(r["ring"] / MB), fmt(r.get("median_s", math.nan) * 1e3, ".1f")]
                    for n, r in rows.items()], "llrrrrlrr"))
    if "temp_unrolled" in rows.get(BASE, {}):
        print(f"\n{BASE}: its unrolled twin (FLOPs, collectives) holds "
              f"{rows[BASE]['temp_unrolled'] / MB:.1f} MiB of temporaries; the table gives "
              "the scanned program's, which users run.")
    if BASE in rows:
        keys = ("ring", "flops", "temp", "time", "resident")
        print(f"\nAgainst {BASE} (targets: collectives <= 1/20, FLOPs <= 0.8, temp <= 0.5, "
              "time <= 0.7; resident / (whole / N) <= 1.1, plus small params).\n")
        print(md_table(["contender", "collectives x", "FLOPs x", "temp x", "time x",
                        "resident / (whole/N)", "targets met"],
                       [[n] + [fmt(r["ratio"][k], ".3f") for k in keys]
                        + [f"{sum(r['passed'].values())}/5"] for n, r in rows.items()
                        if n != BASE], "lrrrrrl"))
        for n, r in rows.items():
            if n != BASE:
                print(f"targets {n}: " + "; ".join(
                    f"{k} {fmt(r['ratio'][k], '.3f')} {'pass' if r['passed'][k] else 'FAIL'}"
                    for k in keys))
    if est:
        print("\nmuon_optax.estimate beside the measured numbers (estimate: the optimizer "
              "alone; a train step's model adds FLOPs, and under jit XLA's all-reduce).\n")
        print(md_table(["contender", "state MiB", "estimate", "equal", "ring MiB", "estimate",
                        "GFLOP", "estimate", "busiest Muon GFLOP (plan, direct form)"],
                       [[n, fmt(rows[n]["state"] / MB, ".4f"), fmt(e["state"] / MB, ".4f"),
                         "yes" if e["state"] == rows[n]["state"] else "NO",
                         fmt(rows[n]["ring"] / MB), fmt(e["ring"] / MB),
                         fmt(rows[n]["flops"] / 1e9), fmt(e["flops"] / 1e9),
                         fmt(e["muon_flops"] / 1e9)] for n, e in est.items()], "lrrlrrrrr"))


# ----------------------------------------------------------------------------- balance

def balance(depth: int, n: int) -> dict[str, float]:
    """The busiest device's Muon FLOPs and state over the exact whole-matrix optimum:
    muon_optax's plan (estimate), per-stack padding, nanochat's per-group chunks."""
    params = common.nanochat_blocks(depth)
    groups = {"matrix": common.nanochat_groups(64 * depth)["matrix"]}
    tx = muon_optax.muon_adamw(groups, lambda p: jax.tree.map(lambda _: "matrix", p),
                               axis_name="data")
    # Per matrix of each stack: (K, FLOPs, state elements: momentum + NorMuon moment).
    cost = {shape: (k, f, s) for shape, k, f, s in common.stack_costs(tx, params, n)}
    (k1, f1, s1), (k2, f2, s2) = cost.values()
    best = (common.exact_optimum(k1, f1, k2, f2, n), common.exact_optimum(k1, s1, k2, s2, n))
    ours = common.busiest_over_optimum(tx, params, n)     # already over the optimum
    # nanochat: a group per PyTorch (out, in) shape, each device ceil(K/N) of every group.
    torch_shapes: dict[tuple[int, ...], int] = {}
    for x in jax.tree.leaves(params):
        torch_shapes[x.shape[::-1]] = torch_shapes.get(x.shape[::-1], 0) + 1
    chunked = [(k,) + cost[tuple(sorted(s))][1:] for s, k in torch_shapes.items()]

    def busiest(parts, i):
        return sum(-(-k // n) * c[i - 1] for k, *c in parts)

    out = {}
    for i, kind in enumerate(("flops", "state")):
        out[f"{kind}_ours"] = ours[i]
        out[f"{kind}_per_stack"] = busiest(cost.values(), i + 1) / best[i]
        out[f"{kind}_nanochat"] = busiest(chunked, i + 1) / best[i]
    return out


def balance_tables(args) -> list[dict[str, Any]]:
    ns = args.balance_devices
    rows = [dict(model=f"d{depth}", **{str(n): balance(depth, n) for n in ns})
            for depth in args.depths]
    for kind, what in (("flops", "Muon FLOPs"), ("state", "Muon state")):
        print(f"\nBusiest device's {what} over the exact whole-matrix optimum: muon_optax / "
              "per-stack padding / nanochat per-group chunks.\n")
        print(md_table(["model"] + [f"N = {n}" for n in ns],
                       [[r["model"]] + [" / ".join(f"{r[str(n)][f'{kind}_{who}']:.2f}" for who
                                                   in ("ours", "per_stack", "nanochat"))
                                        for n in ns] for r in rows], "l" + "r" * len(ns)))
    return rows


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    sets = ", ".join(f"d{w}x{layers}" for w, layers in args.sets)
    print(f"# sharded: {'balance only' if args.only == 'balance' else sets}, vocab {args.vocab}, "
          f"{args.dtype}; N = {N} simulated CPU devices; {common.machine_line()}", flush=True)
    result: dict[str, Any] = dict(config=vars(args))
    if args.only != "balance":
        result["costs"] = [cost_set(args, w, layers) for w, layers in args.sets]
    if args.only != "costs":
        result["balance"] = balance_tables(args)
    common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
