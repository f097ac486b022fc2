"""One run per output folder: every process of a run holds a lock file in ``--out``.

``--out/.lock.<process id>`` is locked with ``flock`` by the process of that id for the
whole run, and holds who holds it (host, pid, start time, command, and the run it
belongs to: ``--coordinator`` and ``--num-processes``). The kernel releases the lock
when the process ends in any way (exit, crash, ``kill -9``), so a killed run never
leaves the folder stuck: the file stays, unlocked, and the next run takes it over.
On NFS, Linux maps ``flock`` to byte-range locks that the server keeps, so processes on
several hosts sharing one ``--out`` see each other's locks.

What is refused, in one line naming the holder (``FolderBusy``):

* a second run on a folder in use: its process 0 finds ``.lock.0`` held; any other of
  its processes finds its own id held, or ``.lock.0`` held by another run (another
  coordinator or process count);
* two processes of one run with the same ``--process-id``: the second finds the id held
  by its own run. It leaves a note (``.refused.<id>``), so that the processes waiting
  for the missing id (:func:`refusals`) can stop and name it too, instead of
  waiting out ``--init-timeout``.

A lock is per open file, so a second run in the same Python process (the tests' in-process
``train.main``) is refused like one in another process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK = ".lock."        # + the process id
REFUSED = ".refused."  # + the process id: a duplicate's note


class FolderBusy(Exception):
    """``--out`` (or this process id in it) is held by a live process: one line."""


def lock_path(out: Path, process_id: int) -> Path:
    return Path(out) / f"{LOCK}{process_id}"


def _read(path: Path) -> dict:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _holder(path: Path, wait_s: float = 2.0) -> dict:
    """What a held lock file says of its holder. A holder writes right after it takes the
    lock, so a file still empty (two processes started at once) is read again briefly."""
    deadline = time.monotonic() + wait_s
    while not (info := _read(path)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return info


def held(path: Path) -> bool:
    """Whether a live process holds the lock on ``path`` (a probe that takes nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
    finally:
        os.close(fd)  # also releases the probe's shared lock
    return False


def describe(info: dict) -> str:
    """``pid 123 on host h, started 2026-01-01 12:00:00 UTC (train.py --out runs/gpt ...)``."""
    if not info:
        return "a process that has not yet said who it is"
    command = " ".join(info.get("command", []))
    command = command if len(command) <= 80 else command[:77] + "..."
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started "
            f"{info.get('started', '?')} (train.py {command})")


class OutLock:
    """The lock of one process id in ``out``; ``release`` (or the process's end) frees it."""

    def __init__(self, out: Path, process_id: int, run: dict, command: list[str]):
        self.out, self.process_id, self.run = Path(out), process_id, run
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "process_id": process_id,
                     "run": run, "command": list(command),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        self._fd: int | None = None

    def acquire(self) -> OutLock:
        """Takes the lock or raises ``FolderBusy``; also checks that process 0's lock, when
        held, belongs to this run. ``OSError``: the folder cannot hold a lock file."""
        path = lock_path(self.out, self.process_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise FolderBusy(self._busy_message(_holder(path))) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(self.info).encode())
        self._fd = fd
        if self.process_id != 0:
            first = lock_path(self.out, 0)
            holder = _read(first)
            if held(first) and holder.get("run") not in (None, self.run):
                self.release()
                raise FolderBusy(f"--out {self.out} is in use by another run: its process 0 is "
                                 f"{describe(holder)}; wait for it to end, or choose another "
                                 f"--out")
        return self

    def _busy_message(self, holder: dict) -> str:
        same_run = holder.get("run") == self.run and self.run.get("coordinator") is not None
        if same_run:  # the same coordinator: a duplicate id, or the command started twice
            self._leave_note()
            return (f"--process-id {self.process_id} is taken in --out {self.out}: "
                    f"{describe(holder)} holds it; give each of the "
                    f"{self.run.get('num_processes')} processes its own --process-id (or, if "
                    f"this run is already going, wait for it to end)")
        return (f"--out {self.out} is in use by another run: {describe(holder)}; wait for it "
                f"to end, or choose another --out")

    def _leave_note(self) -> None:
        """Tells the run's waiting processes that this duplicate was refused."""
        note = self.out / f"{REFUSED}{self.process_id}"
        with contextlib.suppress(OSError):
            tmp = note.with_name(note.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.info))
            tmp.replace(note)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases the lock
            self._fd = None


def refusals(out: Path, run: dict) -> list[tuple[int, dict]]:
    """``(process id, the refused process's info)`` of duplicates of this run refused while
    the id's holder lives: a note newer than the holder's lock (written when it took it)."""
    found = []
    for note in sorted(Path(out).glob(f"{REFUSED}*")):
        suffix = note.name[len(REFUSED):]
        if not suffix.isdigit():
            continue
        lock = lock_path(out, int(suffix))
        try:
            fresh = held(lock) and note.stat().st_mtime >= lock.stat().st_mtime
        except OSError:
            continue
        info = _read(note)
        if fresh and info.get("run") == run:
            found.append((int(suffix), info))
    return found


def missing_ids(out: Path, num_processes: int) -> list[int]:
    """The process ids whose lock no live process holds."""
    return [i for i in range(num_processes) if not held(lock_path(out, i))]
