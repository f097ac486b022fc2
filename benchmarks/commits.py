"""muon_optax's step time at several commits, each against the same torch/optax/matmul yardsticks.

For every commit given, ``git archive COMMIT muon_optax`` is unpacked into a temporary
folder (nothing in the working tree is touched), and a fresh process times that
commit's ``muon_optax.muon_adamw`` step against the PyTorch peer, ``optax.contrib.muon``
and the batched Polar Express matmuls (``step_time.py``'s contenders, same setup),
interleaved, and prints one JSON line: median per-rep ratios, medians, the donated step's
temp bytes and the load average. The contenders other than muon_optax are the working
tree's, so their times tell how fast the machine was during each commit's run.

    PYTHONPATH=. python benchmarks/commits.py 1ec7434 81072c2 82bbce0 HEAD --reps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(commit: str, reps: int, n_embd: int, n_layer: int, vocab: int) -> dict:
    import jax
    import jax.numpy as jnp

    import muon_optax
    from benchmarks import step_time as st
    from benchmarks.params import (
        nanochat_groups,
        nanochat_labels,
        nanochat_params,
        optax_contrib_muon,
        random_grads,
    )

    dev = jax.devices("cpu")[0]
    params = nanochat_params(n_embd, n_layer, vocab, "float32")
    grads = random_grads(params)
    groups = nanochat_groups(n_embd, compute_dtype=jnp.float32)
    tx = muon_optax.muon_adamw(groups, nanochat_labels(params))
    c = {"muon_optax": st.JaxContender(tx, params, grads, dev),
         "optax_contrib": st.JaxContender(optax_contrib_muon(params), params, grads, dev)}
    torch, peer = st.import_peer(str(st.DEFAULT_PEER_DIR), "PASSIVE")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    c["torch"] = st.TorchContender(torch, peer, params, grads, groups, torch.float32,
                                   torch.float32, "cpu")
    stacks = [(s["padded"], *s["shape"]) for s in tx.init.stack_info(params)]
    c["matmul"] = st.MatmulContender(stacks, jnp.float32, 5, dev)
    for x in c.values():
        x.compile()
    for _ in range(3):
        for x in c.values():
            x()
    load = os.getloadavg()
    t = st.time_interleaved(c, reps)
    out = dict(commit=commit, library=str(Path(muon_optax.__file__).parent),
               load_before=load, load_after=os.getloadavg(),
               temp_bytes=c["muon_optax"].memory["temp"],
               median_ms={k: statistics.median(v) * 1e3 for k, v in t.items()})
    for b in ("torch", "optax_contrib", "matmul"):
        out[f"muon_optax/{b}"] = statistics.median(
            [x / y for x, y in zip(t["muon_optax"], t[b])])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commits", nargs="+")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.commits[0], args.reps, args.n_embd, args.n_layer,
                                args.vocab)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for commit in args.commits:
            lib = Path(tmp, commit)
            lib.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "muon_optax"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(lib)], input=archive, check=True)
            # The commit's muon_optax first; benchmarks/ from the working tree after it.
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(lib), str(REPO)]))
            cmd = [sys.executable, "-m", "benchmarks.commits", commit, "--worker",
                   "--reps", str(args.reps), "--n-embd", str(args.n_embd),
                   "--n-layer", str(args.n_layer), "--vocab", str(args.vocab)]
            res = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
            line = res.stdout.strip().splitlines()[-1:] or [res.stderr[-2000:]]
            print(line[0], flush=True)


if __name__ == "__main__":
    main()
