"""What is live in a compiled step's temporary buffer at its peak, from an XLA dump.

Run a benchmark with XLA's dump flags, then point this at the dump folder::

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step" \\
        PYTHONPATH=. python benchmarks/step_time.py --contenders muon_optax --reps 1 --warmup 0
    PYTHONPATH=. python benchmarks/temp_buffers.py /tmp/dump

For every ``*jit_step.cpu_after_optimizations-buffer-assignment.txt`` it reads the values
placed in the ``preallocated-temp`` allocation (name, size, offset, shape), takes each
value's live range from the scheduled entry computation (definition to last use), and
prints the allocation's size and the values live where their sizes sum highest. Values
that share an offset with an operand (in-place updates) are both counted, so the sum can
exceed the allocation.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

MB = 2**20
VALUE = re.compile(r"value: <\d+ (\S+) @0> \(size=(\d+),offset=(\d+)\): (\S+)")
DEF = re.compile(r"\s*(?:ROOT )?%(\S+) = ")


def temp_values(buffer_assignment: str) -> dict[str, tuple[int, int, str]]:
    """name -> (size, offset, shape) of the values in the preallocated temp allocation."""
    start = buffer_assignment.find("preallocated-temp:")
    if start < 0:
        return {}
    section = buffer_assignment[start:].split("\nallocation", 1)[0]
    return {m.group(1): (int(m.group(2)), int(m.group(3)), m.group(4))
            for m in VALUE.finditer(section)}


def live_ranges(hlo: str) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """The entry computation's instructions in schedule order, and each name's first
    (definition) and last (use) position."""
    entry = hlo[hlo.index("\nENTRY"):]
    lines = [ln for ln in entry.splitlines()[1:] if ln.strip().startswith(("%", "ROOT"))]
    first, last = {}, {}
    for i, ln in enumerate(lines):
        m = DEF.match(ln)
        if not m:
            continue
        first[m.group(1)] = i
        for used in re.findall(r"%([\w.\-]+)", ln.split("=", 1)[1]):
            last[used] = i
    return lines, first, last


def report(buffer_assignment: Path, min_bytes: int = 2**16) -> None:
    hlo = Path(str(buffer_assignment).replace("-buffer-assignment.txt", ".txt")).read_text()
    values = temp_values(buffer_assignment.read_text())
    if not values:
        print(f"{buffer_assignment.name}: no preallocated temp")
        return
    lines, first, last = live_ranges(hlo)
    spans = [(first[n], last.get(n, first[n]), n) for n in values if n in first]
    peak, at = 0, 0
    for t in range(len(lines)):
        total = sum(values[n][0] for s, e, n in spans if s <= t <= e)
        if total > peak:
            peak, at = total, t
    extent = max(size + offset for size, offset, _ in values.values())
    print(f"{buffer_assignment.name}: temp allocation {extent / MB:.1f} MiB; values live at "
          f"instruction {at} sum to {peak / MB:.1f} MiB:")
    for s, e, n in sorted((x for x in spans if x[0] <= at <= x[1]),
                          key=lambda x: -values[x[2]][0]):
        size, offset, shape = values[n]
        if size >= min_bytes:
            print(f"  {size / MB:8.2f} MiB at {offset / MB:6.1f}  {n:30s} {shape}  "
                  f"(defined {s}, last used {e})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", help="the --xla_dump_to folder")
    ap.add_argument("--pattern", default="*jit_step.cpu_after_optimizations-buffer-assignment.txt")
    args = ap.parse_args(argv)
    files = sorted(Path(args.dump).glob(args.pattern))
    if not files:
        raise SystemExit(f"no {args.pattern} in {args.dump}")
    for f in files:
        report(f)


if __name__ == "__main__":
    main()
