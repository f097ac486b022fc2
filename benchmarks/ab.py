"""The working tree's muon_optax against an older commit's, in one process, interleaved.

``benchmarks/commits.py`` runs each commit in its own process, one after another, so a
change of a few percent drowns in the machine's drift between runs. Here the older
commit's ``muon_optax`` is unpacked (``git archive``) under another package name,
``muon_optax_<commit>``, and both steps are timed in the same rounds as
``optax.contrib.muon`` (``step_time.py``'s contender), order rotated each round.

Prints, per contender: the donated step's temporary bytes, the median step time and the
median per-round ratios to ``optax_contrib`` and to the older commit; and the largest
parameter difference between the two versions after the warm-up steps (0 when the
change does not alter results).

    PYTHONPATH=. python benchmarks/ab.py f6a439a --reps 40
    PYTHONPATH=. python benchmarks/ab.py f6a439a --n-embd 512 --n-layer 8 --reps 16

``--no-polar`` compiles both library steps with the polar iteration swapped out
(``step_time.polar_swapped_out``): for changes to everything around it, whose few
milliseconds would drown in the iteration's noise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

import muon_optax
from benchmarks import step_time as st
from benchmarks.params import (
    nanochat_groups,
    nanochat_labels,
    nanochat_params,
    optax_contrib_muon,
    random_grads,
)

REPO = Path(__file__).resolve().parents[1]


def import_commit(commit: str, folder: str):
    """``muon_optax`` as of ``commit``, imported as ``muon_optax_<commit>``."""
    name = f"muon_optax_{re.sub(r'[^0-9A-Za-z]', '_', commit)}"
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "muon_optax"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    package = Path(folder, name)
    Path(folder, "muon_optax").rename(package)
    for f in package.glob("*.py"):  # absolute imports name the package
        f.write_text(re.sub(r"\bmuon_optax\b", name, f.read_text()))
    sys.path.insert(0, folder)
    return importlib.import_module(name)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commit", help="the older commit (anything git archive takes)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--no-polar", action="store_true",
                    help="both library steps with the polar iteration swapped out")
    args = ap.parse_args(argv)

    dev = jax.devices("cpu")[0]
    params = nanochat_params(args.n_embd, args.n_layer, args.vocab, "float32")
    grads = random_grads(params)
    groups, labels = nanochat_groups(args.n_embd), nanochat_labels(params)
    with tempfile.TemporaryDirectory() as tmp:
        old = import_commit(args.commit, tmp)
        contenders = {
            "optax_contrib": st.JaxContender(optax_contrib_muon(params), params, grads, dev),
            "working_tree": st.JaxContender(muon_optax.muon_adamw(groups, labels), params,
                                            grads, dev),
            args.commit: st.JaxContender(old.muon_adamw(groups, labels), params, grads, dev),
        }
        for name, c in contenders.items():
            package = {"working_tree": "muon_optax", args.commit: old.__name__}.get(name)
            with (st.polar_swapped_out(package) if args.no_polar and package
                  else contextlib.nullcontext()):
                c.compile()
            for _ in range(args.warmup):
                c()
    new_p = jax.tree.leaves(contenders["working_tree"].params)
    old_p = jax.tree.leaves(contenders[args.commit].params)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(new_p, old_p))
    load = os.getloadavg()
    times = st.time_interleaved(contenders, args.reps)
    print(f"# d{args.n_embd} x {args.n_layer}{' (no polar)' if args.no_polar else ''}, "
          f"{args.reps} rounds; load average "
          f"{load[0]:.1f} before, {os.getloadavg()[0]:.1f} after; params after "
          f"{args.warmup} warm-up steps differ by at most {diff:.2e}")
    print(f"| contender | temp MiB | median ms | /optax_contrib | /{args.commit} |")
    print("|---|---:|---:|---:|---:|")
    for name, c in contenders.items():
        ratios = [statistics.median(x / y for x, y in zip(times[name], times[base]))
                  for base in ("optax_contrib", args.commit)]
        print(f"| {name} | {c.memory['temp'] / 2**20:.1f} | "
              f"{statistics.median(times[name]) * 1e3:.1f} | {ratios[0]:.3f} | {ratios[1]:.3f} |")


if __name__ == "__main__":
    main()
