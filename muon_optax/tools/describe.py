"""``describe``: what the optimizer will do with each parameter, before it runs."""

from __future__ import annotations

import itertools
import sys
from typing import Any, TextIO

import optax

from muon_optax.params.variables import unbox, unboxed_structure
from muon_optax.state.init import init_of


def describe(tx: optax.GradientTransformation, params: Any, *, num_devices: int | None = None,
             file: TextIO | None = sys.stdout) -> list[dict[str, Any]]:
    """Each leaf's path, shape, group, how Muon sees it and which stack it joins.

    Prints a table to ``file`` (``None``: nothing) and returns its rows, a dict per leaf: ``path``,
    ``shape``, ``group``, ``why`` (the :func:`muon_optax.label_by_path` rule that placed it, or
    ``"param_labels"``), ``kind`` (``"adamw"``/``"muon"``); for AdamW leaves ``split``; for Muon
    leaves ``matrices`` (a block counts as one), ``matrix`` (a block's ``(out, in)``), ``blocks``
    (``(output_blocks, reduction_blocks)``), ``stored`` (the stack's ``(R, C)``, ``"transposed"`` if
    stored as the leaf's transpose), ``stack`` (its index), ``transport`` and ``owners`` (devices
    owning its matrices). ``num_devices``: plan for that many devices along the owner axis. Check a
    labelling before training (no bias or norm scale of a scanned Flax model in Muon).
    """
    init = init_of(tx, "describe")
    plan = init.plan(params, num_devices)
    leaves = plan.treedef.flatten_up_to(params)
    # why its labels put each leaf in its group, where the labeller (or its object) says
    labels = init.options.param_labels
    reasons = getattr(labels, "reasons", None) or getattr(
        getattr(labels, "__self__", None), "reasons", None)
    whys = (["param_labels"] * unboxed_structure(params).num_leaves if reasons is None
            else unboxed_structure(params).flatten_up_to(unbox(reasons(params))))
    rows: list[dict[str, Any]] = [dict(path=p, shape=tuple(x.shape), why=w)
                                  for p, x, w in zip(plan.paths, leaves, whys)]
    for a in plan.adamw:
        split = "as laid out" if a.local else "replicated" if a.axis is None else f"axis {a.axis}"
        rows[a.index].update(group=a.group, kind="adamw", split=split)
    for k, sp in enumerate(plan.owner.stacks):
        ends = itertools.accumulate(m.batch for m in sp.stack.members)
        for m, end in zip(sp.stack.members, ends):
            rows[m.index].update(
                group=m.group, kind="muon", matrices=m.batch, matrix=(m.rows, m.cols),
                blocks=m.blocks,
                stored=(sp.stack.rows, sp.stack.cols, "transposed" if m.transposed else ""),
                stack=k, transport=sp.transport,
                owners=sorted({int(d) for d in sp.owners[end - m.batch:end]}))
    if file is not None:
        print(_table(rows, plan.num_devices), file=file)
    return rows


def _table(rows: list[dict[str, Any]], n: int) -> str:
    header = ["path", "shape", "group", "why", "Muon: matrices (out x in)", "stack"] + (
        [f"owners of {n} devices"] if n > 1 else [])
    lines = []
    for r in rows:
        if r["kind"] == "muon":
            rows_, cols_, t = r["stored"]
            blocks = "" if r["blocks"] == (1, 1) else f" ({r['blocks'][0]}x{r['blocks'][1]} blocks)"
            seen = f"{r['matrices']} x {r['matrix'][0]}x{r['matrix'][1]}{blocks}"
            stack = f"#{r['stack']} ({rows_}x{cols_}{', ' + t if t else ''})"
            owners = f"{_ranges(r['owners'])} [{r['transport']}]"   # shown where n > 1
        else:
            seen, stack, owners = "AdamW", "-", r["split"]
        lines.append([r["path"], "x".join(map(str, r["shape"])) or "()",
                      f"{r['group']} ({r['kind']})", r["why"], seen, stack]
                     + ([owners] if n > 1 else []))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*line) for line in [header, ["-" * w for w in widths], *lines])


def _ranges(devices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs = [[d for _, d in run]   # d - i is the same along a run of consecutive devices
            for _, run in itertools.groupby(enumerate(devices), lambda x: x[1] - x[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
