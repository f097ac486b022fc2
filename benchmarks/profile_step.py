"""Where one muon_optax step spends its time on CPU: per-op profile and page faults.

Runs the ``step_time.py`` muon_optax step (params and state donated), then:

- counts minor page faults per step (``getrusage``), which on Linux shows whether XLA's
  per-execution temporary buffer is faulted in afresh every step;
- traces a few steps with ``jax.profiler`` (Perfetto JSON) and sums the time of every HLO
  op, to stdout, largest first (ops on XLA's two threads may overlap, so the sum can
  exceed the step time);
- with ``--checks``, times the standalone patterns the profile points at: a transpose
  alone and fused into an elementwise op, and a stack of 16 arrays into a fresh or a
  donated buffer.

    PYTHONPATH=. python benchmarks/profile_step.py --n-embd 512 --n-layer 8
    PYTHONPATH=. python benchmarks/profile_step.py --no-polar --checks
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import resource
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import muon_optax
from benchmarks import step_time as st
from benchmarks.params import nanochat_groups, nanochat_labels, nanochat_params, random_grads


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def op_times(step, reps: int) -> collections.Counter:
    """Microseconds per HLO op, summed over ``reps`` traced steps."""
    with tempfile.TemporaryDirectory() as out:
        with jax.profiler.trace(out, create_perfetto_trace=True):
            for _ in range(reps):
                step()
        path = glob.glob(f"{out}/**/*.trace.json.gz", recursive=True)[0]
        events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    total = collections.Counter()
    for e in events:
        name = e.get("name", "")
        # HLO ops only: not the executor's own spans nor Python frames.
        if e.get("ph") == "X" and "dur" in e and not name.startswith(("$", "Thunk", "Slinky",
                                                                       "Pjit", "Common")):
            total[name] += e["dur"]
    return total


def checks(reps: int) -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2048, 512), dtype=np.float32))
    xs = [x + i for i in range(16)]  # 64 MiB: above glibc's 32 MiB mmap threshold cap
    rows = [
        ("x * s (4 MiB)", jax.jit(lambda x: x * 1.0001), (x,)),
        ("x.T alone", jax.jit(lambda x: x.T), (x,)),
        ("x.T * s (transpose fused into the loop)", jax.jit(lambda x: x.T * 1.0001), (x,)),
        ("stack of 16 (64 MiB) into a fresh buffer", jax.jit(jnp.stack), (xs,)),
    ]
    print("| standalone check | median ms | minor faults per call |")
    print("|---|---:|---:|")
    for name, fn, args in rows:
        f0 = _faults()
        ms = st.median_ms(lambda: fn(*args), reps)  # noqa: B023
        print(f"| {name} | {ms:.2f} | {(_faults() - f0) / (reps + 1):.0f} |")

    def into(out, xs):
        for i, x in enumerate(xs):
            out = out.at[i].set(x)
        return out

    fill = jax.jit(into, donate_argnums=0)
    state = {"out": jnp.zeros((16, 2048, 512), jnp.float32)}

    def run():
        state["out"] = fill(state["out"], xs)
        return state["out"]

    f0 = _faults()
    ms = st.median_ms(run, reps)
    print(f"| stack of 16 into a donated buffer | {ms:.2f} | {(_faults() - f0) / (reps + 1):.0f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10, help="timed steps for the fault count")
    ap.add_argument("--trace-reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--no-polar", action="store_true",
                    help="swap the polar iteration for one elementwise pass (x * 1.0001)")
    ap.add_argument("--checks", action="store_true", help="also time the standalone checks")
    args = ap.parse_args(argv)

    params = nanochat_params(args.n_embd, args.n_layer, args.vocab, "float32")
    tx = muon_optax.muon_adamw(nanochat_groups(args.n_embd), nanochat_labels(params))
    step = st.JaxContender(tx, params, random_grads(params), jax.devices("cpu")[0])
    with st.polar_swapped_out() if args.no_polar else contextlib.nullcontext():
        step.compile()
    for _ in range(3):
        step()

    f0 = _faults()
    ms = st.median_ms(step, args.reps)
    per_step = (_faults() - f0) / (args.reps + 1)
    temp = step.memory["temp"] / 2**20
    print(f"# d{args.n_embd} x {args.n_layer}{' (no polar)' if args.no_polar else ''}: "
          f"median {ms:.1f} ms over {args.reps} steps; temp {temp:.1f} MiB; "
          f"{per_step:.0f} minor page faults per step = {per_step * 4096 / 2**20:.1f} MiB "
          "of 4 KiB pages")
    total = op_times(step, args.trace_reps)
    print(f"\n| op (top {args.top}; summed over both threads) | ms per step |")
    print("|---|---:|")
    for name, us in total.most_common(args.top):
        print(f"| {name} | {us / args.trace_reps / 1e3:.2f} |")
    print(f"| all ops | {sum(total.values()) / args.trace_reps / 1e3:.1f} |\n")
    if args.checks:
        checks(args.reps)


if __name__ == "__main__":
    main()
