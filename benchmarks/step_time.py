"""Time one optimizer step on a nanochat-shaped set, muon_optax against its peers.

Contenders, in one process, on the same shapes and numbers (``--contenders``):

  muon_optax         muon_optax.muon_adamw, jitted, params and state donated
                     (the default polar_method="auto")
  muon_optax_direct  the same with polar_method="direct" (every polar step on X)
  optax_contrib      optax.contrib.muon, Polar Express coefficients, same jit
  contrib_muon       muon_optax.contrib_muon with exactly optax_contrib's arguments (the
                     same rule on muon_optax's engine: same-shape stacking); target: median
                     per-rep ratio to optax_contrib <= 1.0
  torch              the PyTorch peer TorchMuonAdamW (torch.compile'd; eager in --quick),
                     PyTorch layout; skipped with a note if torch or the peer is missing
  matmul, matmul_2d  roofline reference: only the polar matmuls (Gram, A @ A, B @ X, 5
                     times) on muon_optax's stacks, batched / one 2-D matmul per matrix
  stream             roofline reference: y <- a x + y on two float32 arrays (bandwidth)

After compiling, each of --reps rounds times every contender once, in an order rotated by
one per round. Printed: median step times, medians of per-rep ratios, a roofline (floor =
executed polar FLOPs / the better matmul rate + bytes moved / bandwidth, both measured in
this run; "of floor" = floor / median), and the compiled steps' memory. Before timing, one
step of muon_optax is compared with the peer's, and one of contrib_muon with optax_contrib's.

  PYTHONPATH=. python benchmarks/step_time.py                          # d256x4, vocab 4096
  PYTHONPATH=. python benchmarks/step_time.py --set d512x8 --reps 10
  PYTHONPATH=. python benchmarks/step_time.py --device gpu             # d768x12, 32768, bf16
  PYTHONPATH=. python benchmarks/step_time.py --quick                  # toy size, 3 reps
  PYTHONPATH=. python benchmarks/step_time.py --contenders muon_optax --against main

``--against COMMIT`` adds ``muon_optax@COMMIT``: that commit's package (``git archive``,
imported under another name) on the same step, timed in the same rounds, to compare a
change with where it started (ratio ``muon_optax/muon_optax@COMMIT``).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import muon_optax
from benchmarks import common
from benchmarks.common import MB, fmt, md_table

REPO = Path(__file__).resolve().parents[1]
# The peer beside the checkout, in its shared/ folder, or in .device/ (gpu_check.sh).
PEER_DIRS = [REPO / "shared" / "peers", REPO / ".device" / "peers",
             REPO.parent / "shared" / "peers", REPO.parents[1] / "shared" / "peers"]
DEFAULT_PEER_DIR = next((p for p in PEER_DIRS if p.is_dir()), PEER_DIRS[0])
OURS = ("muon_optax", "muon_optax_direct")
MATMULS = ("matmul", "matmul_2d")
PRESETS = {"cpu": ("d256x4", 4096, "float32"), "gpu": ("d768x12", 32768, "bfloat16")}
RATIOS = [(a, b) for a in OURS for b in ("torch", "optax_contrib")] + [
    ("muon_optax", "matmul_2d"), ("muon_optax", "muon_optax_direct"), ("matmul", "matmul_2d"),
    ("contrib_muon", "optax_contrib")]
TARGETS = {"contrib_muon/optax_contrib": 1.0}   # median per-rep ratio at most


@dataclasses.dataclass
class Contender:
    call: Callable[[], None]  # one step, waited for
    compile_s: float
    flops: float | None = None  # polar matmul FLOPs it executes
    state_bytes: int | None = None  # optimizer state (steps only)
    moved: int | None = None  # bytes a step reads and writes at least
    memory: dict[str, int] | None = None  # memory_analysis of a JAX step
    params: Callable[[], list[np.ndarray]] | None = None  # Flax-layout leaves, float32


@dataclasses.dataclass
class Setup:
    args: Any
    params: Any  # NumPy, Flax layout
    grads: Any
    device: Any
    stacks: list[dict[str, Any]]  # common.stack_rows of muon_optax


def parse_args(argv=None):
    ap = common.base_parser(__doc__)
    ap.set_defaults(vocab=None)
    ap.add_argument("--device", choices=tuple(PRESETS), default="cpu",
                    help="backend and preset (gpu: d768x12, vocab 32768, bf16 polar iteration)")
    ap.add_argument("--set", help="parameter set d<width>x<layers> (default d256x4; gpu d768x12)")
    ap.add_argument("--compute-dtype", help="polar iteration dtype (default float32; gpu bf16)")
    ap.add_argument("--reps", type=int, default=30, help="timed rounds (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds (default 3)")
    ap.add_argument("--contenders", default="muon_optax,muon_optax_direct,optax_contrib,"
                    "contrib_muon,torch,matmul,matmul_2d,stream",
                    help="comma-separated subset (default: all)")
    ap.add_argument("--stream-mib", type=int, default=64, help="MiB per 'stream' array (64)")
    ap.add_argument("--against", help="a commit whose muon_optax runs beside this one")
    ap.add_argument("--peer-dir", default=str(DEFAULT_PEER_DIR),
                    help="folder of torch_muon_adamw.py (default: the first of shared/peers, "
                    ".device/peers in the checkout, shared/peers above it, that exists)")
    args = ap.parse_args(argv)
    preset_set, preset_vocab, preset_compute = PRESETS[args.device]
    if args.quick:
        preset_set, preset_vocab, args.reps, args.warmup, args.stream_mib = "d64x2", 256, 3, 1, 4
    args.width, args.layers = common.parse_set(args.set or preset_set)
    args.vocab = args.vocab or preset_vocab
    args.compute_dtype = args.compute_dtype or preset_compute
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = set(args.contenders) - set(FACTORIES)
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}; choose from {list(FACTORIES)}")
    return args


# ----------------------------------------------------------------------------- contenders

def jax_step(tx: optax.GradientTransformation, s: Setup, flops: float) -> Contender:
    """``params, state = step(params, state, grads)``, params and state donated."""
    # Private copies: device_put may alias NumPy memory on CPU, and the peer writes in place.
    params, grads = (jax.device_put(jax.tree.map(np.array, t), s.device)
                     for t in (s.params, s.grads))
    box = [params, jax.jit(tx.init)(params)]

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state_bytes = common.tree_bytes(box[1])
    moved = 3 * common.tree_bytes(params) + 2 * state_bytes  # read P, G, S; write P, S
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*box, grads).compile()
    compile_s = time.perf_counter() - t0

    def call():
        box[:] = jax.block_until_ready(compiled(*box, grads))

    return Contender(call, compile_s, flops, state_bytes, moved, common.memory_of(compiled),
                     lambda: [np.asarray(x, np.float32) for x in jax.tree.leaves(box[0])])


def muon_optax_contender(s: Setup, method: str, library: Any = muon_optax) -> Contender:
    d, compute = s.args.width, jnp.dtype(s.args.compute_dtype)
    tx = library.muon_adamw(common.nanochat_groups(d, compute_dtype=compute,
                                                      polar_method=method),
                               common.nanochat_labels(s.params))
    key = "flops" if method == "auto" else "direct"
    return jax_step(tx, s, sum(r[key] for r in s.stacks))


def torch_contender(s: Setup) -> Contender:
    """The peer on PyTorch-layout copies of the same params and grads."""
    # Unless set: spinning OpenMP waits made the peer 4-7x slower beside XLA on 2 cores.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.path.insert(0, s.args.peer_dir)
    try:
        import torch
        from torch_muon_adamw import TorchMuonAdamW
    finally:
        sys.path.remove(s.args.peer_dir)
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # as many as XLA:CPU's pool
    dev = "cuda" if s.args.device == "gpu" else "cpu"
    dtype, compute = (getattr(torch, jnp.dtype(x).name) for x in (s.args.dtype,
                                                                    s.args.compute_dtype))
    params, grads = common.to_torch_layout(s.params), common.to_torch_layout(s.grads)
    paths = [muon_optax.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    labels = jax.tree.leaves(common.nanochat_labels(params))
    named = {}
    for path, x, g in zip(paths, jax.tree.leaves(params), jax.tree.leaves(grads)):
        named[path] = torch.nn.Parameter(torch.tensor(np.array(x, np.float32)).to(dev, dtype))
        named[path].grad = torch.tensor(np.array(g, np.float32)).to(dev, dtype)
    groups = common.nanochat_groups(s.args.width)
    opt = TorchMuonAdamW([dict(params=[p for p, lb in zip(named.values(), labels) if lb == n],
                               **hp) for n, hp in groups.items()],
                         compile=not s.args.quick, compute_dtype=compute)

    def call():
        opt.step()
        if dev == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    call()  # torch.compile compiles on the first step (not in --quick: it takes minutes)
    compile_s = time.perf_counter() - t0
    state = sum(v.numel() * v.element_size() for st in opt.state.values()
                for v in st.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
    direct = sum(r["direct"] for r in s.stacks)
    moved = 3 * common.tree_bytes(s.params) + 2 * state
    return Contender(call, compile_s, direct, state, moved, params=lambda: [
        (lambda x: x.T if path.endswith("weight") else x)(p.detach().float().cpu().numpy())
        for path, p in named.items()])


def matmul_contender(s: Setup, batched: bool) -> Contender:
    """Only the polar matmuls, on matrices with orthonormal rows (``(X X^T)^2 X`` stays
    bounded): 3 dots per step, batched over the stack or one 2-D dot per matrix."""
    rng, dtype = np.random.default_rng(0), jnp.dtype(s.args.compute_dtype)
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    xs = []
    for k, r, c in (row["stack"] for row in s.stacks):
        q = np.linalg.qr(rng.standard_normal((k, min(r, c), max(r, c)), dtype=np.float32
                                             ).swapaxes(-1, -2))[0].swapaxes(-1, -2)
        xs.append(jax.device_put(jnp.asarray(q, dtype), s.device))

    def polar(x):
        for _ in range(5):
            a = jnp.matmul(x, jnp.swapaxes(x, -1, -2), precision=precision)
            x = jnp.matmul(jnp.matmul(a, a, precision=precision), x, precision=precision)
        return x

    def run(xs):
        return [polar(x) if batched else jnp.stack([polar(m) for m in x]) for x in xs]

    t0 = time.perf_counter()
    compiled = jax.jit(run).lower(xs).compile()
    compile_s = time.perf_counter() - t0
    return Contender(lambda: jax.block_until_ready(compiled(xs)), compile_s,
                     sum(r["direct"] for r in s.stacks))


def stream_contender(s: Setup) -> Contender:
    """``y <- 0.5 x + y`` on two float32 arrays, y donated: 3 x the array bytes move."""
    n = s.args.stream_mib * MB // 4
    x = jax.device_put(np.full(n, 1e-3, np.float32), s.device)
    box = [jax.device_put(np.zeros(n, np.float32), s.device)]
    compiled = jax.jit(lambda x, y: 0.5 * x + y, donate_argnums=(1,)).lower(x, box[0]).compile()

    def call():
        box[0] = jax.block_until_ready(compiled(x, box[0]))

    return Contender(call, 0.0, moved=3 * n * 4)


FACTORIES: dict[str, Callable[[Setup], Contender]] = {
    "muon_optax": lambda s: muon_optax_contender(s, "auto"),
    "muon_optax_direct": lambda s: muon_optax_contender(s, "direct"),
    "optax_contrib": lambda s: jax_step(common.optax_contrib_muon(s.params), s,
                                        sum(r["direct"] for r in s.stacks)),
    "contrib_muon": lambda s: jax_step(muon_optax.contrib_muon(**common.optax_contrib_args(
        s.params)), s, sum(r["direct"] for r in s.stacks)),
    "torch": torch_contender,
    "matmul": lambda s: matmul_contender(s, batched=True),
    "matmul_2d": lambda s: matmul_contender(s, batched=False),
    "stream": stream_contender,
}


# ----------------------------------------------------------------------------- run and report

def build(s: Setup) -> dict[str, Contender]:
    """Every requested contender, compiled; torch is skipped (with a note) if not importable."""
    out = {}
    for name in s.args.contenders:
        try:
            out[name] = FACTORIES[name](s)
        except ImportError as e:
            if name != "torch":
                raise
            print(f"# torch contender skipped: {e}", flush=True)
            continue
        print(f"#   compiled {name} in {out[name].compile_s:.1f} s", flush=True)
    return out


def _step_difference(after: list[np.ndarray], reference: list[np.ndarray],
                     before: list[np.ndarray]) -> dict[str, Any]:
    """Max relative difference of the parameter change, and the elements off by more than
    1e-3 of the reference's largest change."""
    rel, off = 0.0, 0
    for a, b, p0 in zip(after, reference, before):
        change = np.abs(b - p0)
        rel = max(rel, float(np.linalg.norm(a - b) / max(np.linalg.norm(b - p0), 1e-30)))
        off += int((np.abs(a - b) > 1e-3 * change.max()).sum())
    return dict(max_rel=rel, off=off)


def first_step_check(contenders: dict[str, Contender], params: Any) -> dict[str, Any]:
    """One step from the same start: muon_optax against the peer (which stepped once while
    compiling), contrib_muon against optax_contrib (neither has stepped yet)."""
    before = [np.asarray(x, np.float32) for x in jax.tree.leaves(params)]
    pairs = [(n, "torch") for n in OURS] + [("contrib_muon", "optax_contrib")]
    pairs = [(a, b) for a, b in pairs if a in contenders and b in contenders]
    for name in sorted({x for pair in pairs for x in pair} - {"torch"}):
        contenders[name].call()
    return {f"{a} vs {b}": _step_difference(contenders[a].params(), contenders[b].params(),
                                            before) for a, b in pairs}


def summarize(s: Setup, contenders: dict[str, Contender], times: dict[str, list[float]]):
    """Rows of the step table (with the roofline) and the per-rep ratios."""
    med = {n: statistics.median(t) for n, t in times.items()}
    rate = max((contenders[n].flops / med[n] for n in MATMULS if n in med), default=None)
    bandwidth = contenders["stream"].moved / med["stream"] if "stream" in med else None
    rows = []
    for name, c in contenders.items():
        row = dict(contender=name, median_ms=med[name] * 1e3, flops=c.flops, compile_s=c.compile_s)
        if c.flops:
            row["gflops_per_s"] = c.flops / med[name] / 1e9
        if c.state_bytes is not None:
            row["moved"] = c.moved
            if rate and bandwidth:
                row["floor_ms"] = (c.flops / rate + row["moved"] / bandwidth) * 1e3
                row["of_floor"] = row["floor_ms"] / row["median_ms"]
        rows.append(row)
    ratios = {f"{a}/{b}": common.ratio_stats(times[a], times[b])
              for a, b in RATIOS if a in times and b in times}
    return rows, ratios, dict(matmul_rate=rate, bandwidth=bandwidth)


def print_report(s: Setup, contenders, rows, ratios, rates, checks) -> None:
    grad = max(r["grad_bytes"] for r in s.stacks)
    print(md_table(["stack (K, R, C)", "form run", "executed GFLOP", "rule's GFLOP", "grad MiB"],
                   [(r["stack"], r["method"], fmt(r["flops"] / 1e9), fmt(r["direct"] / 1e9),
                     fmt(r["grad_bytes"] / MB, ".1f")) for r in s.stacks], "llrrr"))
    rate, bandwidth = (rates[k] and rates[k] / 1e9 for k in ("matmul_rate", "bandwidth"))
    print(f"\nRoofline: matmul rate {fmt(rate, '.1f')} GFLOP/s (the better of "
          f"{' and '.join(MATMULS)}), bandwidth {fmt(bandwidth, '.1f')} GB/s (stream).\n")
    print(md_table(["contender", "median ms", "executed GFLOP", "GFLOP/s", "MiB moved",
                    "floor ms", "of floor"],
                   [(r["contender"], fmt(r["median_ms"], ".1f"), fmt(r["flops"] and
                     r["flops"] / 1e9), fmt(r.get("gflops_per_s"), ".1f"),
                     fmt(r.get("moved") and r["moved"] / MB, ".1f"), fmt(r.get("floor_ms"), ".1f"),
                     fmt(r.get("of_floor"))) for r in rows], "lrrrrrr"))
    print()
    print(md_table(["per-rep ratio", "median", "min", "max", "ratio of medians"],
                   [(k, f"{v['median']:.3f}", f"{v['min']:.3f}", f"{v['max']:.3f}",
                     f"{v['of_medians']:.3f}") for k, v in ratios.items()], "lrrrr"))
    print(f"\nCompiled step memory; largest Muon stack's gradient {grad / MB:.1f} MiB.\n")
    mem = {n: c for n, c in contenders.items() if c.memory}
    print(md_table(["contender", "temp MiB", "temp / largest stack grad", "aliased MiB",
                    "donated MiB"],
                   [(n, fmt(c.memory["temp"] / MB, ".1f"), fmt(c.memory["temp"] / grad),
                     fmt(c.memory["alias"] / MB), fmt((common.tree_bytes(s.params)
                                                       + c.state_bytes) / MB))
                    for n, c in mem.items()], "lrrrr"))
    for key, target in TARGETS.items():
        if key in ratios:
            ok = ratios[key]["median"] <= target
            print(f"\nTarget {key}: median per-rep ratio {ratios[key]['median']:.3f} <= "
                  f"{target} ({'pass' if ok else 'FAIL'})")
    for name, c in checks.items():
        print(f"\nFirst step, {name}: max relative difference of the parameter change "
              f"{c['max_rel']:.1e}; {c['off']} element(s) off by > 1e-3 x the largest change"
              + (" (cautious weight-decay mask flips where O * P ~ 0)" if "torch" in name
                 else ""))


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    compute = jnp.dtype(args.compute_dtype)
    params = common.nanochat_params(args.width, args.layers, args.vocab, args.dtype)
    tx = muon_optax.muon_adamw(common.nanochat_groups(args.width), common.nanochat_labels(params))
    s = Setup(args, params, common.random_grads(params), jax.devices(args.device)[0],
              common.stack_rows(tx, params, compute_dtype=compute))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"# step_time: d{args.width} x {args.layers} layers, vocab {args.vocab}, "
          f"{n_params / 1e6:.2f}M params ({args.dtype}), polar iteration in {compute.name}; "
          f"{common.machine_line()}", flush=True)
    contenders = build(s)
    if args.against:
        folder = tempfile.mkdtemp(prefix="step_time_")
        name = f"muon_optax@{args.against}"
        contenders[name] = muon_optax_contender(
            s, "auto", common.import_commit(args.against, folder))
        RATIOS.append(("muon_optax", name))
    checks = first_step_check(contenders, params)
    for _ in range(args.warmup):
        for c in contenders.values():
            c.call()
    load = os.getloadavg()[0]
    times = common.time_interleaved({n: c.call for n, c in contenders.items()}, args.reps)
    rows, ratios, rates = summarize(s, contenders, times)
    print(f"\n{args.reps} interleaved rounds after {args.warmup} warm-up; load average "
          f"{load:.1f} before, {os.getloadavg()[0]:.1f} after.\n")
    print_report(s, contenders, rows, ratios, rates, checks)
    result = dict(config=vars(args), machine=common.machine_line(), stacks=s.stacks, rows=rows,
                  ratios=ratios, rates=rates, checks=checks, times_s=times,
                  memory={n: c.memory for n, c in contenders.items() if c.memory})
    common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
