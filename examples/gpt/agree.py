"""Every process of a ``--distributed`` run must be the same run: checked once at the start.

Processes started with different settings would train on mismatched batches without a
word (another ``--seed``), or wait forever in a collective that the others never reach
(another ``--steps``). So right after ``jax.distributed.initialize`` each process puts
the settings that define the run in a fixed table: every flag but the per-process ones,
the data it read (size and SHA-256) and the code (the example's and ``muon_optax``'s
sources, the versions of jax, optax, orbax and flax). One ``process_allgather`` of the
tables, and every process compares them the same way and refuses, in the same one line,
naming each setting that differs and each process's value (:class:`Disagreement`).

Each entry is a fixed-size row: 16 bytes of the SHA-256 of the setting's name and value
(compared), and the value's first ``TEXT`` bytes (shown). The first row hashes the list
of names, so code that names other settings is caught even where the values agree.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROWS = 64     # settings at most (the first row is the list of names)
DIGEST = 16   # bytes of each setting's SHA-256 compared
TEXT = 40     # bytes of each value shown in the message

# Flags that may differ between the processes of one run: who and where each one is.
PER_PROCESS = frozenset({"process_id", "coordinator", "init_timeout", "no_progress", "out",
                         "data"})
PACKAGES = ("jax", "jaxlib", "optax", "orbax-checkpoint", "flax", "numpy")


class Disagreement(Exception):
    """The processes were started with different settings: one line."""


def code_fingerprint() -> str:
    """SHA-256 (first 16 hex digits) of the example's and the library's Python sources and
    of the installed versions of the packages the step depends on."""
    import muon_optax

    h = hashlib.sha256()
    for folder in (HERE, Path(muon_optax.__file__).resolve().parent):
        for path in sorted(folder.glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    for name in PACKAGES:
        try:
            h.update(f"{name}=={importlib.metadata.version(name)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{name} absent".encode())
    return h.hexdigest()[:16]


def settings(args: argparse.Namespace, data_read: str, code: str) -> list[tuple[str, str]]:
    """``(name, value)`` of what defines the run, names as the user gives them."""
    out = [("--" + k.replace("_", "-"), repr(v)) for k, v in sorted(vars(args).items())
           if k not in PER_PROCESS]
    return out + [("the data read (--data)", data_read), ("the code", code)]


def table(entries: list[tuple[str, str]]) -> np.ndarray:
    """The fixed-size rows exchanged (see the module doc)."""
    if len(entries) + 1 > ROWS:
        raise ValueError(f"{len(entries)} settings; the table holds {ROWS - 1}")
    rows = np.zeros((ROWS, DIGEST + TEXT), np.uint8)
    names = "\0".join(name for name, _ in entries)
    for i, (name, value) in enumerate([("the names", names)] + entries):
        digest = hashlib.sha256(f"{name}\0{value}".encode()).digest()[:DIGEST]
        text = value.encode()[:TEXT]
        rows[i, :DIGEST] = np.frombuffer(digest, np.uint8)
        rows[i, DIGEST:DIGEST + len(text)] = np.frombuffer(text, np.uint8)
    return rows


def differences(tables: np.ndarray, entries: list[tuple[str, str]]) -> str | None:
    """The message for ``tables`` (one per process, ``(P, ROWS, ...)``) that disagree,
    None if all agree. The same on every process: it reads only the gathered tables and
    the names, which the first row has checked."""
    digests = tables[:, :, :DIGEST]
    differ = [i for i in range(ROWS) if (digests[:, i] != digests[0, i]).any()]
    if not differ:
        return None
    if differ[0] == 0:  # other names: another version of train.py on some process
        others = [p for p in range(len(tables)) if (digests[p, 0] != digests[0, 0]).any()]
        return (f"the processes run different code: process {others[0]}'s train.py names "
                f"other settings than process 0's; install the same code on every host")
    parts = []
    for i in differ:
        name = entries[i - 1][0]
        values = []
        for p in range(len(tables)):
            if p == 0 or (digests[p, i] != digests[0, i]).any():
                text = bytes(tables[p, i, DIGEST:]).rstrip(b"\0").decode(errors="replace")
                values.append(f"process {p}: {text}")
        parts.append(f"{name} ({', '.join(values)})")
    return ("the processes were started with different settings: " + "; ".join(parts)
            + "; start every process with the same command but its --process-id")


def check(entries: list[tuple[str, str]]) -> None:
    """Exchanges the settings once (collective: every process calls it at the same
    point) and raises ``Disagreement`` on every process if any differ."""
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(table(entries)))
    message = differences(gathered.reshape(-1, ROWS, DIGEST + TEXT), entries)
    if message is not None:
        raise Disagreement(message)
