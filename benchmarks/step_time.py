"""Time one optimizer step on a nanochat-like parameter set, contenders side by side.

Contenders, all in this one process, on the same shapes and the same numbers:

* ``muon_optax``        muon_optax.muon_adamw, Flax layout, jitted, params and state
                        donated; the library's default ``polar_method="auto"``
* ``muon_optax_direct`` the same groups with ``polar_method="direct"`` (the rule as
                        written: every polar step on X)
* ``optax_contrib``     optax.contrib.muon with the Polar Express coefficient table (see
                        benchmarks/params.py for what it can and cannot match), same jit
* ``torch``             the PyTorch peer TorchMuonAdamW (torch.compile'd), PyTorch layout
* ``matmul``            reference: only the Polar Express matmuls (Gram, A@A, B@X, 5 times)
                        as batched jnp.matmul on the same stacks: the matmul rate
* ``matmul_2d``         the same matmuls, one 2-D jnp.matmul per matrix instead of batched
* ``stream``            reference: a jitted ``y <- a x + y`` on two 64 MiB float32 arrays
                        (y donated): the memory bandwidth (3 x 64 MiB moved)

Every contender is compiled and warmed up first; then each of ``--reps`` repetitions
times every contender once, in an order rotated by one each rep, so that machine noise
hits all of them alike. Reported: the median step time, the median of the per-rep
ratios, the Polar Express matmul FLOPs each contender executes (counted analytically:
the rule's direct form, and for muon_optax the form ``polar_method`` picks per stack,
``muon_optax.polar.polar_flops``), and a roofline: a time floor of executed FLOPs /
(the ``matmul`` rate) + bytes moved / (the ``stream`` bandwidth), both measured in the
same run, and the fraction floor / median each contender achieves. For the jitted
contenders also the compiled step's temporary bytes (``memory_analysis``) and the bytes
aliased to donated inputs.

    PYTHONPATH=. python benchmarks/step_time.py                     # d256 x 4, vocab 4096
    PYTHONPATH=. python benchmarks/step_time.py --n-embd 512 --n-layer 8 --reps 10
    PYTHONPATH=. python benchmarks/step_time.py --device gpu        # d768 x 12, 32768, bf16

The PyTorch peer is imported from ``../shared/peers`` next to the repository (``--peer-dir``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import muon_optax
import muon_optax.polar
from benchmarks.params import (
    muon_flops,
    nanochat_groups,
    nanochat_labels,
    nanochat_params,
    optax_contrib_muon,
    polar_flops,
    random_grads,
    torch_param_groups,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PEER_DIR = REPO.parent / "shared" / "peers"
CONTENDERS = ("muon_optax", "muon_optax_direct", "optax_contrib", "torch", "matmul",
              "matmul_2d", "stream")
OURS = ("muon_optax", "muon_optax_direct")
REFERENCES = ("matmul", "matmul_2d", "stream")
STREAM_BYTES = 64 * 2**20  # per array of the bandwidth reference
MB = 2**20
PRESETS = {  # --device -> (n_embd, n_layer, vocab, compute dtype)
    "cpu": (256, 4, 4096, "float32"),
    "gpu": (768, 12, 32768, "bfloat16"),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=tuple(PRESETS), default="cpu",
                    help="backend and size preset (gpu: d768 x 12 layers, vocab 32768, bf16 "
                         "polar iteration)")
    ap.add_argument("--n-embd", type=int, help="model width (preset: 256 cpu, 768 gpu)")
    ap.add_argument("--n-layer", type=int, help="blocks (preset: 4 cpu, 12 gpu)")
    ap.add_argument("--vocab", type=int, help="vocabulary (preset: 4096 cpu, 32768 gpu)")
    ap.add_argument("--dtype", default="float32", help="parameter dtype (float32|bfloat16)")
    ap.add_argument("--compute-dtype", help="polar iteration dtype (preset: float32 cpu, "
                    "bfloat16 gpu)")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions per contender")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: the CPUs JAX's XLA:CPU pool uses, "
                         "i.e. the process's CPU affinity count)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated subset of {','.join(CONTENDERS)}")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY for torch's OpenMP threads, set before importing "
                         "torch unless already in the environment ('default': leave unset). "
                         "PASSIVE by default: with libgomp's spinning waits the peer ran 4-7x "
                         "slower on the 2-core test machine")
    ap.add_argument("--stream-mib", type=int, default=STREAM_BYTES // MB,
                    help="size of each of the two float32 arrays of the 'stream' bandwidth "
                         "reference, MiB")
    ap.add_argument("--peer-dir", default=str(DEFAULT_PEER_DIR),
                    help="folder holding torch_muon_adamw.py")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    n_embd, n_layer, vocab, compute = PRESETS[args.device]
    args.n_embd = args.n_embd or n_embd
    args.n_layer = args.n_layer or n_layer
    args.vocab = args.vocab or vocab
    args.compute_dtype = args.compute_dtype or compute
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}; choose from {CONTENDERS}")
    return args


# ----------------------------------------------------------------------------- contenders

class JaxContender:
    """``params, state = step(params, state, grads)`` with params and state donated."""

    def __init__(self, tx: optax.GradientTransformation, params: Any, grads: Any,
                 device: jax.Device):
        # Private copies: on CPU, device_put may alias the NumPy memory (zero-copy), and
        # the torch contender shares (and updates in place) NumPy memory too.
        self.params = jax.device_put(jax.tree.map(np.array, params), device)
        self.grads = jax.device_put(jax.tree.map(np.array, grads), device)
        self.state = jax.jit(tx.init)(self.params)

        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self.step = jax.jit(step, donate_argnums=(0, 1))
        self.run: Callable = self.step  # the executable itself once compile() has run
        self.param_bytes = _nbytes(self.params)
        self.grad_bytes = _nbytes(self.grads)
        self.state_bytes = _nbytes(self.state)
        self.memory: dict[str, int] = {}

    def compile(self) -> float:
        t0 = time.perf_counter()
        compiled = self.step.lower(self.params, self.state, self.grads).compile()
        seconds = time.perf_counter() - t0
        self.run = compiled
        m = compiled.memory_analysis()
        self.memory = dict(temp=int(m.temp_size_in_bytes), alias=int(m.alias_size_in_bytes),
                           argument=int(m.argument_size_in_bytes),
                           output=int(m.output_size_in_bytes))
        return seconds

    def __call__(self) -> None:
        self.params, self.state = self.run(self.params, self.state, self.grads)
        jax.block_until_ready((self.params, self.state))


@contextlib.contextmanager
def polar_swapped_out(package: str = "muon_optax"):
    """Within: ``package`` traces one elementwise pass (``x * 1.0001``) for the polar iteration.

    For benchmarks that time everything but the iteration: compile inside, run after (a
    compiled :class:`JaxContender` keeps the program it compiled). ``package``: another
    copy of the library, such as ``ab.py``'s older commit.
    """
    module = sys.modules[f"{package}.muon"]  # the package exports a function named `muon`
    polar = module.polar_express_stack
    module.polar_express_stack = lambda x, ns_steps, method: x * 1.0001
    try:
        yield
    finally:
        module.polar_express_stack = polar


def _nbytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


class MatmulContender:
    """Only the matmuls of Polar Express, batched over stacks ``(K, R, C)`` with R <= C.

    Starts from matrices with orthonormal rows, for which ``X <- (X X^T)^2 X`` stays
    bounded, so no scaling or polynomial terms are needed: 3 dot ops per iteration.
    ``batched=False`` does the same with one 2-D matmul per matrix (a Python loop).
    """

    def __init__(self, stacks: list[tuple[int, int, int]], dtype: Any, ns_steps: int,
                 device: jax.Device, seed: int = 0, batched: bool = True):
        rng = np.random.default_rng(seed)
        xs = []
        for k, r, c in stacks:
            q = np.linalg.qr(rng.standard_normal((k, c, r), dtype=np.float32))[0]
            xs.append(jnp.asarray(np.swapaxes(q, -1, -2), dtype))  # (k, r, c), rows orthonormal
        self.xs = jax.device_put(xs, device)
        self.flops = sum(k * polar_flops(r, c, ns_steps) for k, r, c in stacks)
        precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
        mm = lambda a, b: jnp.matmul(a, b, precision=precision)  # noqa: E731

        def polar(x):
            for _ in range(ns_steps):
                a = mm(x, jnp.swapaxes(x, -1, -2))
                x = mm(mm(a, a), x)
            return x

        def run(xs):
            if batched:
                return [polar(x) for x in xs]
            return [jnp.stack([polar(x[i]) for i in range(x.shape[0])]) for x in xs]

        self.run = jax.jit(run)

    def compile(self) -> float:
        t0 = time.perf_counter()
        self.run.lower(self.xs).compile()
        return time.perf_counter() - t0

    def __call__(self) -> None:
        jax.block_until_ready(self.run(self.xs))


class StreamContender:
    """Memory bandwidth reference: ``y <- a x + y`` on two float32 arrays, ``y`` donated.

    Moves ``3 x nbytes`` per call (read x, read y, write y in place).
    """

    def __init__(self, nbytes: int, device: jax.Device):
        n = nbytes // 4
        self.x = jax.device_put(np.full(n, 1e-3, np.float32), device)
        self.y = jax.device_put(np.zeros(n, np.float32), device)
        self.bytes = 3 * n * 4
        self.run = jax.jit(lambda x, y: 0.5 * x + y, donate_argnums=(1,))

    def compile(self) -> float:
        t0 = time.perf_counter()
        self.run.lower(self.x, self.y).compile()
        return time.perf_counter() - t0

    def __call__(self) -> None:
        self.y = jax.block_until_ready(self.run(self.x, self.y))


class TorchContender:
    """The PyTorch peer on PyTorch-layout copies of the same params and grads."""

    def __init__(self, torch, peer_cls, params_flax: Any, grads_flax: Any,
                 groups: dict[str, Any], dtype: Any, compute_dtype: Any, device: str):
        from benchmarks.params import to_torch_layout

        self.torch, self.device = torch, device
        params, grads = to_torch_layout(params_flax), to_torch_layout(grads_flax)
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        paths = [muon_optax.path_str(p) for p, _ in flat]
        labels = dict(zip(paths, jax.tree.leaves(nanochat_labels(params))))
        self.named = {}
        for path, x, g in zip(paths, jax.tree.leaves(params), jax.tree.leaves(grads)):
            p = torch.nn.Parameter(self._tensor(x, dtype))
            p.grad = self._tensor(g, dtype)
            self.named[path] = p
        self.opt = peer_cls(torch_param_groups(self.named, groups, labels), compile=True,
                            compute_dtype=compute_dtype)

    def _tensor(self, x: np.ndarray, dtype):
        # A copy: torch.from_numpy shares memory, and the peer updates params in place.
        return self.torch.from_numpy(np.array(x, np.float32)).to(self.device, dtype)

    def compile(self) -> float:  # torch.compile compiles on the first call
        t0 = time.perf_counter()
        self()
        return time.perf_counter() - t0

    def __call__(self) -> None:
        self.opt.step()
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def state_bytes(self) -> int:
        """Bytes of the peer's tensor state (after its first step)."""
        return sum(v.numel() * v.element_size() for st in self.opt.state.values()
                   for v in st.values() if isinstance(v, self.torch.Tensor) and v.numel() > 1)

    def flax_params(self) -> list[np.ndarray]:
        """The current params, leaves in flattening order, back in Flax layout."""
        out = []
        for path, p in self.named.items():
            x = p.detach().float().cpu().numpy()
            out.append(x.T if path.endswith("weight") else x)
        return out


def import_peer(peer_dir: str, omp_wait_policy: str = "default"):
    if omp_wait_policy != "default":
        os.environ.setdefault("OMP_WAIT_POLICY", omp_wait_policy)
    sys.path.insert(0, peer_dir)
    try:
        import torch
        from torch_muon_adamw import TorchMuonAdamW
    finally:
        sys.path.remove(peer_dir)
    return torch, TorchMuonAdamW


# ----------------------------------------------------------------------------- timing

def median_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` (waited for), after one untimed."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_interleaved(contenders: dict[str, Callable[[], None]], reps: int
                     ) -> dict[str, list[float]]:
    """``reps`` rounds; each times every contender once, order rotated by one per round."""
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def machine_info(threads: dict[str, Any]) -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                      if ln.startswith("Model name")), platform.processor())
    except OSError:
        model = platform.processor()
    info = dict(cpu=model, cpus=os.cpu_count(), affinity=len(os.sched_getaffinity(0)),
                python=platform.python_version(), jax=jax.__version__,
                jaxlib=jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
                optax=optax.__version__, backend=jax.default_backend(),
                jax_device=str(jax.devices()[0]), xla_flags=os.environ.get("XLA_FLAGS", ""),
                **threads)
    return info


def executed_flops(stack_info: list[dict[str, Any]], ns_steps: int, method: str,
                   compute: Any) -> tuple[int, list[dict[str, Any]]]:
    """Polar Express matmul FLOPs muon_optax executes: per stack, the form it runs.

    ``muon_optax.polar.choose_method`` gives the form a stack runs with (``auto``: Gram
    space for float32 rectangular stacks where it saves FLOPs), ``polar_flops`` its
    FLOPs; every slot counts, padding included (none on one device).
    """
    total, rows = 0, []
    for s in stack_info:
        r, c = s["shape"]
        chosen = muon_optax.polar.choose_method(r, c, ns_steps, method, compute)
        f = s["padded"] * muon_optax.polar.polar_flops(r, c, ns_steps, chosen)
        d = s["padded"] * muon_optax.polar.polar_flops(r, c, ns_steps, "direct")
        rows.append(dict(stack=(s["padded"], r, c), method=chosen, flops=f, direct_flops=d))
        total += f
    return total, rows


def _ratio(a: list[float], b: list[float]) -> dict[str, float]:
    per_rep = [x / y for x, y in zip(a, b)]
    return dict(median=statistics.median(per_rep), min=min(per_rep), max=max(per_rep),
                of_medians=statistics.median(a) / statistics.median(b))


def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    backend = "gpu" if args.device == "gpu" else "cpu"
    jdev = jax.devices(backend)[0]
    compute = jnp.dtype(args.compute_dtype)
    jax_threads = len(os.sched_getaffinity(0))
    threads: dict[str, Any] = {"jax_threads": jax_threads}

    params = nanochat_params(args.n_embd, args.n_layer, args.vocab, args.dtype)
    grads = random_grads(params)
    groups = nanochat_groups(args.n_embd, compute_dtype=compute)
    method = groups["matrix"].get("polar_method", "auto")  # the library's default
    groups_direct = {k: dict(v) for k, v in groups.items()}
    groups_direct["matrix"]["polar_method"] = "direct"
    labels = nanochat_labels(params)
    ns_steps = groups["matrix"]["ns_steps"]
    direct_flops = muon_flops(params, ns_steps)  # the rule as written, every matrix
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    param_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(params))

    ours_tx = muon_optax.muon_adamw(groups, labels)
    info_stacks = ours_tx.init.stack_info(params)
    exec_flops, stack_rows = executed_flops(info_stacks, ns_steps, method, compute)
    itemsize = np.dtype(jax.tree.leaves(params)[0].dtype).itemsize
    for row, s in zip(stack_rows, info_stacks):
        row["grad_bytes"] = s["size"] * s["shape"][0] * s["shape"][1] * itemsize
    largest_grad = max(r["grad_bytes"] for r in stack_rows)
    flops = {"muon_optax": exec_flops, "muon_optax_direct": direct_flops,
             "optax_contrib": direct_flops, "torch": direct_flops}

    contenders: dict[str, Any] = {}
    if "muon_optax" in args.contenders:
        contenders["muon_optax"] = JaxContender(ours_tx, params, grads, jdev)
    if "muon_optax_direct" in args.contenders:
        contenders["muon_optax_direct"] = JaxContender(
            muon_optax.muon_adamw(groups_direct, labels), params, grads, jdev)
    if "optax_contrib" in args.contenders:
        contenders["optax_contrib"] = JaxContender(optax_contrib_muon(params), params, grads,
                                                   jdev)
    if "torch" in args.contenders:
        torch, peer_cls = import_peer(args.peer_dir, args.omp_wait_policy)
        torch.set_num_threads(args.threads or jax_threads)
        threads.update(torch_threads=torch.get_num_threads(),
                       torch_interop_threads=torch.get_num_interop_threads(),
                       torch=torch.__version__,
                       omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(unset)"))
        tdtype = getattr(torch, jnp.dtype(args.dtype).name)
        tcompute = getattr(torch, compute.name)
        contenders["torch"] = TorchContender(
            torch, peer_cls, params, grads, groups, tdtype, tcompute,
            "cuda" if backend == "gpu" else "cpu")
    stacks = [(s["padded"], *s["shape"]) for s in info_stacks]
    if "matmul" in args.contenders:
        contenders["matmul"] = MatmulContender(stacks, compute, ns_steps, jdev)
    if "matmul_2d" in args.contenders:
        contenders["matmul_2d"] = MatmulContender(stacks, compute, ns_steps, jdev,
                                                  batched=False)
    if "stream" in args.contenders:
        contenders["stream"] = StreamContender(args.stream_mib * MB, jdev)
    for name in REFERENCES[:2]:
        if name in contenders:
            flops[name] = contenders[name].flops

    print(f"# step_time: d{args.n_embd} x {args.n_layer} layers, vocab {args.vocab}, "
          f"{n_params / 1e6:.2f}M params ({args.dtype}), polar iteration in {compute.name}, "
          f"Muon matmul FLOPs/step: rule (direct) {direct_flops / 1e9:.2f} G, muon_optax "
          f"(polar_method={method!r}) executes {exec_flops / 1e9:.2f} G", flush=True)
    load_before = os.getloadavg()
    compile_s = {}
    for name, c in contenders.items():
        compile_s[name] = c.compile()
        print(f"#   compiled {name} in {compile_s[name]:.1f} s", flush=True)

    # One step from identical params and grads: muon_optax and the peer must agree.
    checks = {}
    if "torch" in contenders:
        before = [np.array(x, np.float32) for x in jax.tree.leaves(params)]
        after_peer = contenders["torch"].flax_params()  # it stepped while compiling
        for name in OURS:
            if name not in contenders:
                continue
            contenders[name]()
            after = [np.asarray(x, np.float32) for x in jax.tree.leaves(contenders[name].params)]
            rel, outliers = [], 0
            for a, b, p0 in zip(after, after_peer, before):
                change = np.linalg.norm(b - p0)
                rel.append(float(np.linalg.norm(a - b) / change) if change > 0 else 0.0)
                outliers += int((np.abs(a - b) > 1e-3 * np.abs(b - p0).max()).sum())
            checks[name] = dict(max_rel=max(rel), outliers=outliers)
            print(f"#   first step, {name} vs torch peer: max relative difference of the "
                  f"parameter change {max(rel):.2e}; {outliers} element(s) off by more "
                  "than 1e-3 of the largest change", flush=True)

    # State each contender reads and writes (torch's exists after its first step).
    state_bytes = {n: c.state_bytes for n, c in contenders.items() if isinstance(c, JaxContender)}
    if "torch" in contenders:
        state_bytes["torch"] = contenders["torch"].state_bytes()
    grad_bytes = param_bytes
    moved = {n: 2 * param_bytes + grad_bytes + 2 * s for n, s in state_bytes.items()}

    for _ in range(args.warmup):
        for c in contenders.values():
            c()
    times = time_interleaved(contenders, args.reps)
    load_after = os.getloadavg()

    medians = {n: statistics.median(t) for n, t in times.items()}
    matmul_rate = flops["matmul"] / medians["matmul"] if "matmul" in medians else None
    # the better of the batched and the per-matrix rate: a stricter floor
    best_rate = max([flops[n] / medians[n] for n in REFERENCES[:2] if n in medians],
                    default=None)
    bandwidth = contenders["stream"].bytes / medians["stream"] if "stream" in medians else None
    rows = []
    for name, t in times.items():
        row = dict(contender=name, median_ms=medians[name] * 1e3, min_ms=min(t) * 1e3,
                   max_ms=max(t) * 1e3, compile_s=compile_s[name])
        if name in flops:
            row.update(flops=flops[name], gflops=flops[name] / medians[name] / 1e9)
        if name not in REFERENCES:
            row["direct_gflops"] = direct_flops / medians[name] / 1e9
        if name in moved:
            row.update(bytes_moved=moved[name], state_bytes=state_bytes[name])
            if matmul_rate and bandwidth:
                row["flop_floor_ms"] = flops[name] / matmul_rate * 1e3
                row["byte_floor_ms"] = moved[name] / bandwidth * 1e3
                row["floor_ms"] = row["flop_floor_ms"] + row["byte_floor_ms"]
                row["achieved"] = row["floor_ms"] / row["median_ms"]
                row["achieved_best_rate"] = (flops[name] / best_rate * 1e3
                                             + row["byte_floor_ms"]) / row["median_ms"]
        c = contenders[name]
        if isinstance(c, JaxContender):
            row["memory"] = dict(c.memory, temp_over_largest_stack_grad=(
                c.memory["temp"] / largest_grad), donated_bytes=c.param_bytes + c.state_bytes)
        rows.append(row)
    ratios = {}
    pairs = [(a, b) for a in OURS for b in ("torch", "optax_contrib", "matmul", "matmul_2d")]
    pairs += [("muon_optax", "muon_optax_direct"), ("matmul", "matmul_2d")]
    for a, b in pairs:
        if a in times and b in times:
            ratios[f"{a}/{b}"] = _ratio(times[a], times[b])

    info = machine_info(threads)
    info["loadavg_before"], info["loadavg_after"] = load_before, load_after
    print()
    print(f"Machine: {info['cpu']}, {info['affinity']} CPUs; jax {info['jax']} "
          f"({info['backend']}), optax {info['optax']}"
          + (f", torch {info['torch']}" if "torch" in info else ""))
    print(f"Threads: XLA:CPU pool {jax_threads} (CPU affinity count, no XLA_FLAGS override)"
          + (f"; torch.set_num_threads({info['torch_threads']}), interop "
             f"{info['torch_interop_threads']}, OMP_WAIT_POLICY={info['omp_wait_policy']}"
             if "torch_threads" in info else ""))
    print("Load average (1, 5, 15 min) before / after: "
          + " / ".join(", ".join(f"{x:.1f}" for x in la)
                       for la in (info["loadavg_before"], info["loadavg_after"]))
          + f" on {info['affinity']} CPUs (other processes share this machine)")
    print(f"Reps: {args.reps} interleaved (rotating order) after {args.warmup} warm-up steps")
    print()
    print(f"Muon stacks (polar_method={method!r}, {ns_steps} steps; FLOPs analytic, "
          "muon_optax.polar.polar_flops):\n")
    print("| stack (K, R, C) | form run | executed GFLOP | rule's direct GFLOP | grad MiB |")
    print("|---|---|---:|---:|---:|")
    for r in stack_rows:
        print(f"| {r['stack']} | {r['method']} | {r['flops'] / 1e9:.2f} | "
              f"{r['direct_flops'] / 1e9:.2f} | {r['grad_bytes'] / MB:.1f} |")
    print(f"| total | | {exec_flops / 1e9:.2f} | {direct_flops / 1e9:.2f} | |")
    print()
    print("| contender | median ms | min ms | max ms | executed GFLOP | executed GFLOP/s | "
          "rule's direct GFLOP / median, GFLOP/s | compile s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ex = (f"{r['flops'] / 1e9:.2f} | {r['gflops']:.1f}" if "flops" in r else "- | -")
        dg = f"{r['direct_gflops']:.1f}" if "direct_gflops" in r else "-"
        print(f"| {r['contender']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | "
              f"{r['max_ms']:.1f} | {ex} | {dg} | {r['compile_s']:.1f} |")
    if ratios:
        print()
        print("| per-rep ratio | median | min | max | ratio of medians |")
        print("|---|---:|---:|---:|---:|")
        for k, v in ratios.items():
            print(f"| {k} | {v['median']:.3f} | {v['min']:.3f} | {v['max']:.3f} | "
                  f"{v['of_medians']:.3f} |")
    roof = [r for r in rows if "floor_ms" in r]
    if roof:
        print()
        print(f"Roofline: matmul rate {matmul_rate / 1e9:.1f} GFLOP/s (the 'matmul' "
              f"contender's median), bandwidth {bandwidth / 1e9:.1f} GB/s (the 'stream' "
              f"contender: 3 x {args.stream_mib} MiB per y <- a x + y, median). Bytes moved "
              "per step (minimal count): read params + grads + optimizer state, write "
              "params + state (state = AdamW m, v; Muon momentum, second moment; "
              "optax_contrib: its own state tree; torch: the peer's state tensors). "
              "floor = executed FLOPs / matmul rate + bytes / bandwidth; achieved = floor / "
              "median. optax_contrib and torch are credited with the rule's direct FLOPs. "
              f"'achieved, best rate': the same with the better of the batched and 2-D "
              f"matmul rates ({best_rate / 1e9:.1f} GFLOP/s).\n")
        print("| contender | executed GFLOP | MiB moved | FLOP floor ms | byte floor ms | "
              "floor ms | median ms | achieved | target >= 0.90 | achieved, best rate |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|:---:|---:|")
        for r in roof:
            print(f"| {r['contender']} | {r['flops'] / 1e9:.2f} | {r['bytes_moved'] / MB:.1f} "
                  f"| {r['flop_floor_ms']:.1f} | {r['byte_floor_ms']:.1f} | "
                  f"{r['floor_ms']:.1f} | {r['median_ms']:.1f} | {r['achieved']:.2f} | "
                  f"{verdict(r['achieved'] >= 0.9)} | {r['achieved_best_rate']:.2f} |")
    mem = [r for r in rows if "memory" in r]
    if mem:
        print()
        print(f"Compiled step memory (memory_analysis). Largest Muon stack gradient: "
              f"{largest_grad / MB:.1f} MiB (size x R x C x itemsize, from stack_info). "
              "Donated = params + state bytes; aliased = output bytes XLA reuses from "
              "donated inputs.\n")
        print("| contender | temp MiB | temp / largest stack grad | target <= 3 (ours) | "
              "aliased MiB | donated MiB | all donated |")
        print("|---|---:|---:|:---:|---:|---:|:---:|")
        for r in mem:
            m = r["memory"]
            target = (verdict(m["temp_over_largest_stack_grad"] <= 3)
                      if r["contender"] in OURS else "-")
            print(f"| {r['contender']} | {m['temp'] / MB:.1f} | "
                  f"{m['temp_over_largest_stack_grad']:.2f} | {target} | {m['alias'] / MB:.2f} "
                  f"| {m['donated_bytes'] / MB:.2f} | "
                  f"{'yes' if m['alias'] >= m['donated_bytes'] else 'NO'} |")
    targets = {}
    for b in ("torch", "optax_contrib"):
        key = f"muon_optax/{b}"
        if key in ratios:
            targets[f"{key} <= 0.8"] = ratios[key]["median"] <= 0.8
    print()
    for k, ok in targets.items():
        print(f"Target {k} (median per-rep ratio {ratios[k.split(' ')[0]]['median']:.3f}): "
              f"{verdict(ok)}")
    for name, check in checks.items():
        print(f"First-step agreement {name} vs torch peer: {check['max_rel']:.2e} (max "
              "over params of |dP_ours - dP_torch| / |dP_torch|); "
              f"{check['outliers']} element(s) off by > 1e-3 x max|dP| (cautious weight-decay "
              "mask flips where O*P ~ 0)")
    print("\n('matmul' rows: the same 3 matmuls x 5 iterations on the same stacks and nothing "
          "else, batched (K, R, C) or one 2-D matmul per matrix ('matmul_2d'); their GFLOP/s "
          "is the matmul rate XLA reaches on these shapes.)")

    result = dict(config=vars(args), machine=info, muon_flops_direct=direct_flops,
                  muon_flops_executed=exec_flops, polar_method=method, stacks=stack_rows,
                  n_params=n_params, param_bytes=param_bytes,
                  largest_stack_grad_bytes=largest_grad, matmul_rate=matmul_rate,
                  best_matmul_rate=best_rate, bandwidth=bandwidth, rows=rows, ratios=ratios,
                  targets=targets,
                  first_step_rel_diff=checks, times_s={k: list(v) for k, v in times.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return result

if __name__ == "__main__":
    main()
