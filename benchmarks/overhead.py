"""How much of muon_optax's step is the polar iteration: the floor under the speed ratios.

Times, interleaved in one process: ``optax.contrib.muon`` and ``muon_optax`` (the
``step_time.py`` contenders), and ``polar_only``: nothing but
``muon_optax.polar.polar_express_stack`` on stacks of the same shapes (the library's
``polar_method``, per matrix on CPU), already scaled, with no momentum, statistics,
scaling, stacking or update around it; and ``no_polar``: muon_optax's whole step with
the polar iteration replaced by one elementwise pass (``x * 1.0001``, so the data flow
stays), i.e. what everything else costs on its own. ``polar_only / optax_contrib`` is the
ratio muon_optax would reach if everything but its polar iteration were free.

``no_transposes`` is muon_optax on a what-if model whose MLP ``c_proj`` kernels are laid
out ``(d, 4d)`` like ``c_fc`` (same shapes, FLOPs and stacks): every matrix is then stored
as laid out, so it shows what the transposes of ``c_proj`` into and out of the MLP stack
cost.

    PYTHONPATH=. python benchmarks/overhead.py --reps 30
    PYTHONPATH=. python benchmarks/overhead.py --n-embd 512 --n-layer 8 --reps 10
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax
import numpy as np

import muon_optax
from benchmarks import step_time as st
from benchmarks.params import (
    basin_scaled,
    nanochat_groups,
    nanochat_labels,
    nanochat_params,
    optax_contrib_muon,
    random_grads,
)
from muon_optax.polar import polar_express_stack


class PolarOnly:
    """The polar iteration alone, on one random, basin-scaled stack per Muon stack."""

    def __init__(self, stacks: list[tuple[int, int, int]], method: str):
        rng = np.random.default_rng(0)
        self.xs = jax.device_put([basin_scaled(rng, shape) for shape in stacks])
        fn = jax.jit(lambda xs: [polar_express_stack(x, 5, method) for x in xs])
        self.run = fn.lower(self.xs).compile()

    def __call__(self) -> None:
        jax.block_until_ready(self.run(self.xs))


def _mlp_proj_transposed(tree):
    """The MLP ``c_proj`` kernels ``(4d, d)`` transposed to ``(d, 4d)``; the rest as is."""
    def fix(path, x):
        name = jax.tree_util.keystr(path)
        return np.ascontiguousarray(x.T) if "mlp" in name and "c_proj" in name else x
    return jax.tree_util.tree_map_with_path(fix, tree)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args(argv)

    dev = jax.devices("cpu")[0]
    params = nanochat_params(args.n_embd, args.n_layer, args.vocab, "float32")
    grads = random_grads(params)
    groups = nanochat_groups(args.n_embd)
    tx = muon_optax.muon_adamw(groups, nanochat_labels(params))
    stacks = [(s["padded"], *s["shape"]) for s in tx.init.stack_info(params)]
    contenders = {
        "optax_contrib": st.JaxContender(optax_contrib_muon(params), params, grads, dev),
        "muon_optax": st.JaxContender(tx, params, grads, dev),
        "polar_only": PolarOnly(stacks, groups["matrix"].get("polar_method", "auto")),
        "no_polar": st.JaxContender(tx, params, grads, dev),  # compiled without it, below
        "no_transposes": st.JaxContender(tx, _mlp_proj_transposed(params),
                                         _mlp_proj_transposed(grads), dev),
    }
    for name, c in contenders.items():
        if name == "no_polar":
            with st.polar_swapped_out():
                c.compile()
        elif hasattr(c, "compile"):
            c.compile()
        for _ in range(3):
            c()
    load = os.getloadavg()
    times = st.time_interleaved(contenders, args.reps)
    print(f"# d{args.n_embd} x {args.n_layer}, stacks {stacks}, {args.reps} rounds; load "
          f"average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| contender | median ms | /optax_contrib | /muon_optax |")
    print("|---|---:|---:|---:|")
    for name in contenders:
        ratios = [statistics.median(x / y for x, y in zip(times[name], times[base]))
                  for base in ("optax_contrib", "muon_optax")]
        print(f"| {name} | {statistics.median(times[name]) * 1e3:.1f} | {ratios[0]:.3f} | "
              f"{ratios[1]:.3f} |")


if __name__ == "__main__":
    main()
