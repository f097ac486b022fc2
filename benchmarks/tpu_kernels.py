"""Where the TPU compiler's time goes, kernel by kernel (deviceless AOT, like ``tpu_compile.py``).

Most of a step's compile on the TPU compiler is its backend building each kernel (a
fusion, or an op left alone) of the optimized HLO; identical kernels are built once.
With its verbose log on, libtpu names every kernel it builds, with its size in LLO
instructions and the time its scheduling and bundle packing take. This script compiles
one contender of ``tpu_compile.py`` in a child process with that log on, and sums those
times by the source line that made each kernel (the optimized HLO's stack frames): the
lines whose programs cost the compiler most.

  python -m benchmarks.tpu_kernels fsdp d768x12 v5p:8            # the 20 costliest lines
  python -m benchmarks.tpu_kernels fsdp d768x12 v5p:8 --depth 2  # with their callers

The totals line compares the kernels' count and size with another contender's
(``--against optax_fsdp``). Times are CPU seconds of a loaded machine: read them as
shares.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from typing import NamedTuple

# libtpu's log: the backend's kernels, their times, and the stages' durations.
LOG_ENV = {"TPU_MIN_LOG_LEVEL": "0", "TPU_STDERR_LOG_LEVEL": "0",
           "TPU_VMODULE": "deepsea_compiler_backend=2,deepsea_compiler_base=1",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+(\d+) ")
_KERNEL = re.compile(r"\] \[(.*?)\] LLO optimizing ([\d,]+) instructions")
_TIME = re.compile(r"(?:graph-based optimizations and scheduling|total bundle packing) time: "
                   r"([\d.]+) (us|ms|s)\b")
_STAGE = re.compile(r"(HLO_PASSES|BACKEND_PASSES|CODE_GENERATION|END_TO_END) stage duration: "
                    r"(?:(\d+)m(?!s))?([\d.]+)(us|ms|s)\b")   # 1023.3ms, 20.5s, 1m2.5s
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class Kernel(NamedTuple):
    name: str            # the HLO instruction it was built for ("<no-hlo-instruction>": glue)
    instructions: int    # LLO instructions before scheduling
    seconds: float       # scheduling and bundle packing


def read_log(log: str) -> tuple[list[Kernel], dict[str, float]]:
    """The kernels the backend built, in order, and the stages' durations (seconds).

    Kernels are built on several threads: a time line belongs to the kernel its thread
    last named."""
    current: dict[str, list] = {}
    kernels: list[list] = []
    stages: dict[str, float] = {}
    for line in log.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        thread = m.group(1)
        if k := _KERNEL.search(line):
            current[thread] = [k.group(1), int(k.group(2).replace(",", "")), 0.0]
            kernels.append(current[thread])
        elif (t := _TIME.search(line)) and thread in current:
            current[thread][2] += float(t.group(1)) * _UNIT[t.group(2)]
        elif s := _STAGE.search(line):
            stages[s.group(1)] = 60 * int(s.group(2) or 0) + float(s.group(3)) * _UNIT[s.group(4)]
    return [Kernel(*k) for k in kernels], stages


def source_lines(hlo: str) -> dict[str, list[str]]:
    """Each instruction's source location, innermost first (``file:function:line``),
    from the stack frame tables at the end of an optimized HLO's text."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := re.match(r"(\d+) (.*)", line)):
            current[int(m.group(1))] = m.group(2).strip('"')

    def fields(text: str) -> dict[str, int]:
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}

    def place(i: int) -> str:
        f = fields(tables["FileLocations"][i])
        path = tables["FileNames"][f["file_name_id"]]
        short = path.split("site-packages/")[-1].split("muon_optax/")[-1]
        return f"{short}:{tables['FunctionNames'][f['function_name_id']]}:{f['line']}"

    def chain(frame: int) -> list[str]:
        out, seen = [], set()
        while frame > 0 and frame not in seen and frame in tables.get("StackFrames", {}):
            seen.add(frame)
            f = fields(tables["StackFrames"][frame])
            out.append(place(f["file_location_id"]))
            frame = f.get("parent_frame_id", 0) - 1   # printed one past the caller's id
        return out

    where = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?stack_frame_id=(\d+)", hlo, re.M):
        where.setdefault(m.group(1), chain(int(m.group(2))))
    return where


def by_source(kernels: list[Kernel], where: dict[str, list[str]],
              depth: int = 1) -> list[tuple[str, int, int, float]]:
    """``(source, kernels, LLO instructions, seconds)`` per source line (its ``depth``
    innermost frames), costliest first."""
    total: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])
    for k in kernels:
        key = " < ".join(where.get(k.name, [])[:depth]) or "(no source: glue, copies)"
        total[key][0] += 1
        total[key][1] += k.instructions
        total[key][2] += k.seconds
    return sorted(((s, *v) for s, v in total.items()), key=lambda r: -r[3])


def compile_logged(contender: str, set_name: str, topology: str, vocab: int,
                   timeout: float) -> tuple[list[Kernel], dict[str, float], str]:
    """Compiles in a child process with libtpu's log on: its kernels, stages and HLO."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step.hlo")
        cmd = [sys.executable, "-m", "benchmarks.tpu_kernels", "--child", contender,
               set_name, topology, path, "--vocab", str(vocab)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **LOG_ENV},
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if out.returncode or not os.path.exists(path):
            raise RuntimeError(f"{contender} {set_name} {topology} did not compile:\n"
                               + "\n".join(out.stderr.strip().splitlines()[-5:]))
        with open(path) as f:
            hlo = f.read()
    return *read_log(out.stderr), hlo


def _child(contender: str, set_name: str, topology: str, path: str, vocab: int) -> None:
    from benchmarks import common, tpu_compile

    width, layers = common.parse_set(set_name)
    params = common.nanochat_params(width, layers, vocab, abstract=True)
    fn, args, _, _ = tpu_compile.build(contender, params, tpu_compile.topology_devices(topology))
    with open(path, "w") as f:
        f.write(fn.lower(*args).compile().as_text())


def _totals(name: str, kernels: list[Kernel], stages: dict[str, float]) -> str:
    return (f"{name}: {len(kernels)} kernels, {sum(k.instructions for k in kernels):,} LLO "
            f"instructions, {sum(k.seconds for k in kernels):.1f} s building them; stages: "
            + ", ".join(f"{s} {v:.1f} s" for s, v in stages.items()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("contender")
    ap.add_argument("set")
    ap.add_argument("topology")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--depth", type=int, default=1, help="frames per source (1: the line)")
    ap.add_argument("--against", help="another contender: its totals too")
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--child":   # contender set topology path [--vocab V]
        a = ap.parse_args(argv[1:4] + argv[5:])
        _child(a.contender, a.set, a.topology, argv[4], a.vocab)
        return
    a = ap.parse_args(argv)
    kernels, stages, hlo = compile_logged(a.contender, a.set, a.topology, a.vocab, a.timeout)
    print(_totals(a.contender, kernels, stages))
    if a.against:
        other, other_stages, _ = compile_logged(a.against, a.set, a.topology, a.vocab,
                                                a.timeout)
        print(_totals(a.against, other, other_stages))
    print(f"\n| seconds | kernels | LLO instructions | source ({a.contender}, {a.set}, "
          f"{a.topology}) |\n|---:|---:|---:|---|")
    for source, n, size, seconds in by_source(kernels, source_lines(hlo), a.depth)[:a.top]:
        print(f"| {seconds:.2f} | {n} | {size:,} | `{source}` |")


if __name__ == "__main__":
    main()
