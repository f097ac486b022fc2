"""What the benchmarks share: parameter sets, timing, compiled-program analysis, tables.

* Parameter sets ``d<width>x<layers>`` (``d256x4``, ``d512x8``): the GPT of ``examples/gpt``
  as NumPy dicts, nanochat's groups and labels, ``optax.contrib.muon`` as close to the rule
  as it goes (``optax_contrib_args``, also ``contrib_muon``'s), FSDP specs, the PyTorch
  layout for the peer.
* Balance: nanochat's block matrices at any depth, the exact whole-matrix optimum.
* Timing: contenders interleaved in a rotating order; medians of the per-rep ratios.
* Compiled programs: collectives from the HLO text (ring bytes per device and kind),
  ``cost_analysis`` FLOPs, ``memory_analysis`` bytes, bytes per device.
* Output: markdown tables in the layout of BENCHMARKS.md, so that a run can be pasted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

import muon_optax
import muon_optax.rule.polar

MB = 2**20

# nanochat's base_train defaults (examples/gpt/optim_setup.py), as constants.
EMBEDDING_LR, UNEMBEDDING_LR, MATRIX_LR, SCALAR_LR = 0.3, 0.008, 0.02, 0.5
WEIGHT_DECAY, ADAM_BETAS, ADAM_EPS, REFERENCE_D_MODEL = 0.28, (0.8, 0.95), 1e-10, 768
LABEL_RULES = ((r"^wte/", "embed"), (r"^lm_head/", "lm_head"), (r"^resid_lambdas", "resid"),
               (r"^x0_lambdas", "x0"), (r"^blocks/", "matrix"))


# ----------------------------------------------------------------------------- parameter sets

def parse_set(name: str) -> tuple[int, int]:
    """``"d256x4"`` -> ``(256, 4)``: model width and number of blocks."""
    m = re.fullmatch(r"d(\d+)x(\d+)", name)
    if not m:
        raise argparse.ArgumentTypeError(f"a set is d<width>x<layers>, e.g. d256x4; got {name!r}")
    return int(m.group(1)), int(m.group(2))


def block_shapes(d: int) -> dict[tuple[str, str], tuple[int, int]]:
    """Flax ``(in, out)`` shapes of one block's matrices."""
    square = {("attn", n): (d, d) for n in ("c_q", "c_k", "c_v", "c_proj")}
    return {**square, ("mlp", "c_fc"): (d, 4 * d), ("mlp", "c_proj"): (4 * d, d)}


def numpy_dtype(dtype: Any) -> np.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``jnp.bfloat16`` ... as a NumPy dtype."""
    name = jnp.dtype(dtype).name
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def nanochat_params(d: int = 256, n_layer: int = 4, vocab: int = 4096, dtype: Any = "float32",
                    seed: int = 0, abstract: bool = False) -> dict[str, Any]:
    """The parameter tree in Flax layout: ``wte/embedding (vocab, d)``, per block
    ``attn/c_{q,k,v,proj}/kernel (d, d)`` and ``mlp/c_fc (d, 4d)``, ``mlp/c_proj (4d, d)``,
    ``lm_head/kernel (d, vocab)``, ``resid_lambdas``, ``x0_lambdas (n_layer,)``.

    Matrices N(0, 1/fan_in) (the output projections too, so that the cautious weight-decay
    mask is not trivially all-true), embedding N(0, 1), head N(0, 1e-3), lambdas 1 and 0.1.
    ``abstract``: ``jax.ShapeDtypeStruct`` leaves, nothing allocated.
    """
    rng, np_dtype = np.random.default_rng(seed), numpy_dtype(dtype)

    def normal(shape, std):
        if abstract:
            return jax.ShapeDtypeStruct(shape, np_dtype)
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np_dtype)

    def const(value):
        return (jax.ShapeDtypeStruct((n_layer,), np_dtype) if abstract
                else np.full((n_layer,), value, np_dtype))

    blocks = {i: {"attn": {}, "mlp": {}} for i in range(n_layer)}
    for block in blocks.values():
        for (sub, name), (fan_in, fan_out) in block_shapes(d).items():
            block[sub][name] = {"kernel": normal((fan_in, fan_out), fan_in ** -0.5)}
    return {"wte": {"embedding": normal((vocab, d), 1.0)}, "blocks": blocks,
            "lm_head": {"kernel": normal((d, vocab), 1e-3)},
            "resid_lambdas": const(1.0), "x0_lambdas": const(0.1)}


def random_grads(params: Any, seed: int = 1, scale: float = 1e-2) -> Any:
    """Random gradients shaped like ``params`` (NumPy, same dtypes)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: (rng.standard_normal(p.shape, dtype=np.float32) * scale
                                   ).astype(p.dtype), params)


def to_torch_layout(tree: Any) -> Any:
    """Flax layout -> PyTorch layout: every ``kernel`` becomes its transpose ``weight``."""
    if not isinstance(tree, Mapping):
        return tree
    return {("weight" if k == "kernel" else k):
            (np.ascontiguousarray(v.T) if k == "kernel" else to_torch_layout(v))
            for k, v in tree.items()}


def nanochat_groups(d: int, *, compute_dtype: Any = None,
                    polar_method: str | None = None) -> dict[str, dict[str, Any]]:
    """``muon_optax.muon_adamw`` groups with nanochat's (constant) hyperparameters."""
    scale = (d / REFERENCE_D_MODEL) ** -0.5

    def adamw(lr, betas=ADAM_BETAS):
        return dict(kind="adamw", lr=lr, betas=betas, eps=ADAM_EPS, weight_decay=0.0)

    options = {k: v for k, v in dict(compute_dtype=compute_dtype,
                                     polar_method=polar_method).items() if v is not None}
    return {"lm_head": adamw(UNEMBEDDING_LR * scale), "embed": adamw(EMBEDDING_LR * scale),
            "resid": adamw(SCALAR_LR * 0.01), "x0": adamw(SCALAR_LR, betas=(0.96, 0.95)),
            "matrix": dict(kind="muon", lr=MATRIX_LR, momentum=0.95, ns_steps=5, beta2=0.95,
                           weight_decay=WEIGHT_DECAY, **options)}


def nanochat_labels(params: Any) -> Any:
    """The group of every leaf (either layout)."""
    return muon_optax.label_by_path(LABEL_RULES, matrix="unmatched", other="unmatched")(params)


def optax_contrib_args(params: Any) -> dict[str, Any]:
    """``optax.contrib.muon``'s arguments, as close to nanochat's rule as its options go.

    The Polar Express table as ``ns_coeffs`` (optax scans over its rows), Nesterov momentum
    0.95, lr 0.02, decoupled weight decay 0.28, Muon on the block matrices only; its AdamW
    (betas (0.8, 0.95), one lr: the embedding's) for the rest. It cannot express MuonEq,
    Muon+, NorMuon, cautious weight decay, per-group AdamW lrs or same-shape stacking.
    ``muon_optax.contrib_muon`` takes the same arguments.
    """
    d = params["wte"]["embedding"].shape[1]
    dims = jax.tree.map(lambda label: optax.contrib.MuonDimensionNumbers(0, 1)
                        if label == "matrix" else None, nanochat_labels(params))
    return dict(learning_rate=MATRIX_LR, ns_coeffs=muon_optax.POLAR_EXPRESS_COEFFS, ns_steps=5,
                beta=0.95, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY, nesterov=True,
                adam_b1=ADAM_BETAS[0], adam_b2=ADAM_BETAS[1],
                adam_learning_rate=EMBEDDING_LR * (d / REFERENCE_D_MODEL) ** -0.5,
                muon_weight_dimension_numbers=dims)


def optax_contrib_muon(params: Any, **overrides: Any) -> optax.GradientTransformation:
    """``optax.contrib.muon(**optax_contrib_args(params))``, some arguments overridden."""
    return optax.contrib.muon(**{**optax_contrib_args(params), **overrides})


def fsdp_spec(shape: Sequence[int], n: int, axis: str = "data") -> jax.sharding.PartitionSpec:
    """FSDP: split along the first axis divisible by ``n``; replicated if there is none."""
    first = next((i for i, size in enumerate(shape) if size % n == 0), None)
    return jax.sharding.PartitionSpec(*(axis if i == first else None
                                        for i in range(len(shape))))


def stack_rows(tx: optax.GradientTransformation, params: Any, num_devices: int = 1,
               compute_dtype: Any = None) -> list[dict[str, Any]]:
    """muon_optax's Muon stacks with their polar FLOPs: per stack ``(K, R, C)`` (K padded
    to a multiple of ``num_devices``), the form ``polar_method="auto"`` runs in
    ``compute_dtype``, its FLOPs over all K slots and the rule's direct-form FLOPs."""
    dtype = compute_dtype or muon_optax.rule.polar.default_compute_dtype()
    rows = []
    for s in tx.init.stack_info(params, num_devices=num_devices):
        (r, c), k = s["shape"], s["padded"]
        method = muon_optax.rule.polar.choose_method(r, c, 5, "auto", dtype)
        rows.append(dict(stack=(k, r, c), size=s["size"], method=method,
                         flops=k * muon_optax.rule.polar.polar_flops(r, c, 5, method),
                         direct=k * muon_optax.rule.polar.polar_flops(r, c, 5, "direct"),
                         grad_bytes=s["size"] * r * c * np.dtype(s["dtype"]).itemsize))
    return rows


def tree_bytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- balance

def nanochat_blocks(depth: int) -> dict[str, Any]:
    """nanochat's block matrices in Flax ``(in, out)`` layout, width 64 x depth, as
    ``jax.ShapeDtypeStruct``s: per layer c_q, c_k, c_v, c_proj ``(w, w)``, c_fc
    ``(w, 4w)`` and c_proj ``(4w, w)`` (embedding and head left out: AdamW's)."""
    w = 64 * depth
    layer = {"attn": {k: (w, w) for k in ("c_q", "c_k", "c_v", "c_proj")},
             "mlp": {"c_fc": (w, 4 * w), "c_proj": (4 * w, w)}}
    shapes = {"blocks": {str(i): layer for i in range(depth)}}
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def exact_optimum(k1: int, c1: int, k2: int, c2: int, n: int) -> int:
    """Least max per-device load over all assignments of ``k1`` matrices of cost ``c1`` and
    ``k2`` of cost ``c2`` to ``n`` devices, whole matrices only.

    A binary search over the loads a device can have; a load ``M`` is feasible when some
    split of the ``k1`` big matrices over the devices leaves room for all ``k2`` small
    ones: a knapsack over how many big ones each device takes, the rest of ``M`` filled
    with small ones.
    """
    loads = sorted({a * c1 + b * c2 for a in range(k1 + 1) for b in range(k2 + 1)})

    def feasible(m):
        smalls = [(m - a * c1) // c2 for a in range(min(k1, m // c1) + 1)]
        best = np.full(k1 + 1, -1 << 40)    # most small ones placed, per big ones placed
        best[0] = 0
        for _ in range(n):
            new = np.full(k1 + 1, -1 << 40)
            for a, s in enumerate(smalls):
                new[a:] = np.maximum(new[a:], best[:k1 + 1 - a] + s)
            best = new
        return best[k1] >= k2

    lo, hi = 0, len(loads) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(loads[mid]) else (mid + 1, hi)
    return loads[lo]


def stack_costs(tx: optax.GradientTransformation, params: Any,
                n: int) -> list[tuple[tuple[int, int], int, int, int]]:
    """Per kind of matrix in ``tx``'s plan for ``n`` devices, the costliest first: its
    stored shape (sorted), matrix count, and one matrix's FLOPs and state elements
    (momentum + NorMuon moment), as the owner plan counts them
    (``muon_optax.plan.plan.matrix_flops``). Stacks of transposed shapes (an MLP's ``c_fc``
    and ``c_proj``, each stored as laid out) cost the same and count as one kind."""
    from muon_optax.plan.plan import matrix_flops

    kinds: dict[tuple, int] = {}
    for sp in tx.init.plan(params, n).owner.stacks:
        key = (tuple(sorted((sp.stack.rows, sp.stack.cols))), matrix_flops(sp.stack),
               sp.stack.rows * sp.stack.cols + sp.second_size)
        kinds[key] = kinds.get(key, 0) + sp.stack.size
    return sorted(((shape, k, f, s) for (shape, f, s), k in kinds.items()),
                  key=lambda c: -c[2])


def busiest_over_optimum(tx: optax.GradientTransformation, params: Any,
                         n: int) -> tuple[float, float]:
    """The busiest device's Muon FLOPs and Muon state (``muon_optax.estimate``) over the
    exact optimum of each (:func:`exact_optimum`), for params all on Muon in two stacks."""
    (_, k1, f1, s1), (_, k2, f2, s2) = stack_costs(tx, params, n)
    est = muon_optax.estimate(tx, params, n)
    itemsize = np.dtype(jax.tree.leaves(params)[0].dtype).itemsize
    state = (max(est["state_bytes"]) - 4) / itemsize          # 4: the step count
    return (max(est["muon_flops"]) / exact_optimum(k1, f1, k2, f2, n),
            state / exact_optimum(k1, s1, k2, s2, n))


# ----------------------------------------------------------------------------- timing

def time_interleaved(calls: Mapping[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds of ``reps`` rounds; each round calls every contender once (each call waits for
    its result), the order rotated by one per round."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def ratio_stats(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Per-rep ratios ``a/b``: median, min, max; and the ratio of the medians."""
    per_rep = [x / y for x, y in zip(a, b)]
    return dict(median=statistics.median(per_rep), min=min(per_rep), max=max(per_rep),
                of_medians=statistics.median(a) / statistics.median(b))


# ----------------------------------------------------------------------------- compiled programs

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_COLLECTIVE = re.compile(r"=\s*(?P<type>.*?)\s(?P<op>all-reduce|all-gather|reduce-scatter|"
                         r"all-to-all|collective-permute)(?P<suffix>-start|-done)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_CHAIN = re.compile(r'chain_id="([^"]*)"')
# Bytes one device sends on a ring, per payload byte, for a group of n devices.
_RING_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "collective-permute": lambda n: 1.0}


def _arrays(type_str: str) -> list[tuple[int, int]]:
    """``(elements, bytes)`` of each array in an HLO result type."""
    out = []
    for dtype, dims in _ARRAY.findall(type_str):
        n = math.prod(int(d) for d in dims.split(",") if d)
        out.append((n, n * DTYPE_BYTES.get(dtype, 4)))
    return out


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len([d for d in m.group(1).split(",") if d])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)  # iota form [groups,size]<=[...]
    if m:
        return int(m.group(2))
    # mesh form (the TPU compiler's): replica_groups=mesh['data'=4,'model'=2] {'model'}, the
    # group the named axes of the mesh
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        named = re.findall(r"'([^']+)'", m.group(2))
        if named and all(a in sizes for a in named):
            return math.prod(sizes[a] for a in named)
    return num_devices


def collectives(hlo: str, num_devices: int,
                chains: set | None = None) -> dict[str, dict[str, float]]:
    """The collectives of a compiled HLO module, per kind: ``count``, ``elements`` and
    ``bytes`` of the payload, and ``ring``: the bytes each device sends on a ring.

    The payload is an op's full-size buffer: the result of an all-reduce or all-gather, the
    operand of a reduce-scatter (result x group size n). A ring sends ``(n-1)/n`` of it per
    device for reduce-scatter, all-gather and all-to-all, ``2 (n-1)/n`` for all-reduce.
    Async pairs count once (at ``-start``, whose all-gather result is the tuple's second half).
    So does a collective the TPU compiler splits into pieces run inside several fusions
    (between an ``AsyncCollectiveStart`` and ``AsyncCollectiveDone``, each piece the whole
    op with the chain's ``chain_id``): counted at its first piece (``chains``: the chains
    already counted, shared by the calls for one module's computations).
    """
    ops: dict[str, dict[str, float]] = {}
    chains = set() if chains is None else chains
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if not m or m.group("suffix") == "-done":
            continue
        chain = _CHAIN.search(line)
        if chain:   # one piece of a collective the TPU compiler runs across fusions
            key = (chain.group(1), m.group("op"), tuple(_arrays(m.group("type"))))
            if key in chains:
                continue
            chains.add(key)
        op, arrays = m.group("op"), _arrays(m.group("type"))
        if m.group("suffix") == "-start" and op in ("all-gather", "collective-permute"):
            arrays = arrays[len(arrays) // 2:] if op == "all-gather" else arrays[1:2]
        n = _group_size(line, num_devices)
        scale = n if op == "reduce-scatter" else 1
        elements, nbytes = (scale * sum(a[i] for a in arrays) for i in (0, 1))
        entry = ops.setdefault(op, dict(count=0, elements=0, bytes=0, ring=0.0))
        entry["count"] += 1
        entry["elements"] += elements
        entry["bytes"] += nbytes
        entry["ring"] += _RING_FACTOR.get(op, lambda n: (n - 1) / n)(n) * nbytes
    return ops


def cost_flops(compiled: Any) -> float:
    """``compiled.cost_analysis()["flops"]`` (a scan's body counts once)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", float("nan")))


def memory_of(compiled: Any) -> dict[str, int]:
    """``memory_analysis`` bytes: temporaries, aliased (donated inputs reused)."""
    m = compiled.memory_analysis()
    return dict(temp=int(m.temp_size_in_bytes), alias=int(m.alias_size_in_bytes))


def per_device_bytes(tree: Any, devices: Sequence[Any]) -> list[int]:
    """Bytes of ``tree``'s arrays held on each device (addressable shards)."""
    totals = dict.fromkeys(devices, 0)
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            totals[shard.device] += shard.data.nbytes
    return [totals[d] for d in devices]


# ----------------------------------------------------------------------------- output

def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str) -> str:
    """A markdown table; ``align`` has one letter per column: ``l``, ``r`` or ``c``."""
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x: float | None, spec: str = ".2f") -> str:
    """``x`` formatted, ``-`` for None or NaN."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return (f"{cpu}, {len(os.sched_getaffinity(0))} CPUs; jax {jax.__version__} "
            f"({jax.default_backend()}), optax {optax.__version__}")


def base_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the docstring as help and the flags every script has."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=4096,
                    help="vocabulary size (default 4096; --quick 256)")
    ap.add_argument("--dtype", default="float32", help="parameter dtype (default float32)")
    ap.add_argument("--quick", action="store_true",
                    help="a toy size and few reps: checks that the script runs (about a minute)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    return ap


def write_json(path: str | None, result: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)


def import_commit(commit: str, folder: str):
    """``muon_optax`` as of ``commit`` (``git archive`` into ``folder``), imported as
    ``muon_optax_<commit>``, to measure it beside this checkout in one process."""
    name = f"muon_optax_{re.sub(r'[^0-9A-Za-z]', '_', commit)}"
    repo = Path(__file__).resolve().parents[1]
    saved = repo / ".device" / f"{commit}.tar"   # a device machine gets no .git: see gpu_check
    archive = saved.read_bytes() if saved.exists() else subprocess.run(
        ["git", "-C", str(repo), "archive", commit, "muon_optax"],
        check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    package = Path(folder, name)
    Path(folder, "muon_optax").rename(package)
    for f in package.glob("*.py"):  # its absolute imports name the package
        f.write_text(re.sub(r"\bmuon_optax\b", name, f.read_text()))
    sys.path.insert(0, folder)
    return importlib.import_module(name)
