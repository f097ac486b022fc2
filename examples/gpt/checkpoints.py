"""orbax checkpoints of the GPT example: ``ckpt/<step>/{params,opt_state,meta}``.

What a checkpoint holds does not depend on the devices or the mode it was written in:
the params as global arrays, and the optimizer state in a portable form (``StateForm``):
MuonAdamW's as ``muon_optax.export_state`` gives it (per parameter: AdamW moments,
Muon momentum, NorMuon second moment), ``optax.adamw``'s as optax keeps it (global
arrays with the params' shapes). A restore reads them into arrays placed for the
current run (restore targets built from shapes, with the current shardings), and
``muon_optax.import_state`` lays the MuonAdamW state out for the current device count
and mode. So ``--resume`` continues on another ``--devices``, with or without
``--fsdp``, with one process or several.

What orbax's ``CheckpointManager`` options give here:

* ``save_decision_policy``: a save every ``--ckpt-every`` steps, and one at the agreed
  stop (jax's preemption sync point in a multi-process run, see ``stopping.py``);
* ``cleanup_tmp_directories``: the temporary folder of a write that was interrupted
  (``<step>.orbax-checkpoint-tmp-*``) is removed when the next run opens the directory;
  ``latest_step`` never sees it, so ``--resume`` takes the last complete checkpoint.

Saves are asynchronous: the training loop goes on while orbax writes, and ``close``
waits for the last write.

What this module adds to orbax:

* a content checksum (``checksum.json`` in the step's folder: size and SHA-256 of every
  file) written once orbax has finished the step, and verified before a restore. A
  checkpoint without one was cut off between orbax's write and the checksum (or comes
  from an earlier ``train.py``) and counts as incomplete. ``find_intact`` names the
  newest intact step and the damaged or incomplete ones after it; ``set_aside`` renames
  those ``damaged-<step>`` (orbax does not list them), so training continues past them;
* ``--keep-ckpts``: the newest intact checkpoints stay; older ones are deleted only once
  a newer one carries its checksum, so a failed save (full disk, lost mount) never costs
  the previous checkpoint. orbax's own ``max_to_keep`` would delete it as soon as the new
  step is written, before the checksum;
* a failed write (orbax reports it in its thread, at the next wait) becomes
  ``CheckpointError``: one line saying what failed and which checkpoint is kept.

The manager is told the agreed stop (``save(..., stop=True)``) instead of asking jax's
sync point itself: orbax asks ``reached_preemption(step)`` also from the thread that
finishes an asynchronous save, and that would report an older step to jax's sync
protocol while training is already further on. The protocol keeps the last step each
process reported, so it could place the stop at a step the loop has passed, and nobody
would stop. The training loop alone asks jax, once per step.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

PORTABLE = "muon_optax.export_state"   # meta["state"] of MuonAdamW checkpoints
OPTAX = "optax"                        # ... of optax.adamw ones


class StateForm(NamedTuple):
    """How one optimizer's state goes into a checkpoint and comes back.

    ``save(state)`` gives the tree written; ``load(tree)`` the state placed for the train
    step; ``target`` is the written tree as shape structs with the shardings to read it
    into; ``kind`` is stored in the checkpoint's meta (a checkpoint of another kind,
    e.g. of an earlier ``train.py``, is refused).
    """

    kind: str
    save: Callable
    load: Callable
    target: Any


def with_shardings(shapes, shardings):
    """Shape structs carrying ``shardings`` (one for all, or a tree like ``shapes``)."""
    import jax

    def struct(x, sharding):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: struct(x, shardings), shapes)
    return jax.tree.map(struct, shapes, shardings)


def portable_form(tx, abstract_params, abstract_state, state_shardings, layout) -> StateForm:
    """MuonAdamW's state as ``muon_optax.export_state`` gives it, split over the devices
    by FSDP's rule (``layout.split_specs``) while it is written and read.

    ``num_devices`` matters only to the ``shard_map`` (ZeRO-2) form of ``tx``, which
    does not know its device count; the mesh and one-device forms ignore it.
    """
    import jax

    import muon_optax

    n = layout.num_devices

    def export(state):
        return muon_optax.export_state(tx, state, abstract_params, num_devices=n)

    shapes = jax.eval_shape(export, abstract_state)
    spread = layout.shardings(layout.split_specs(shapes))
    save = jax.jit(export, out_shardings=spread)
    load = jax.jit(lambda portable: muon_optax.import_state(tx, portable, abstract_params,
                                                            num_devices=n),
                   out_shardings=state_shardings)
    return StateForm(PORTABLE, save, load, with_shardings(shapes, spread))


def optax_form(abstract_state, state_shardings) -> StateForm:
    """An optax state as it is: global arrays shaped like the params, the same in every
    mode; read straight into the current shardings."""
    return StateForm(OPTAX, lambda state: state, lambda state: state,
                     with_shardings(abstract_state, state_shardings))


CHECKSUM = "checksum.json"  # in each step's folder, written after orbax's files
DAMAGED = "damaged-"        # prefix of a step moved aside (orbax lists only <step>)


class CheckpointError(Exception):
    """A checkpoint could not be written: one line for the user (see ``write_problem``)."""


def _file_digests(step_dir: Path) -> dict[str, list]:
    """``{relative path: [size, sha256]}`` of every file under ``step_dir`` but the checksum."""
    digests = {}
    for path in sorted(step_dir.rglob("*")):
        rel = path.relative_to(step_dir).as_posix()
        if rel == CHECKSUM or not path.is_file():
            continue
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        digests[rel] = [path.stat().st_size, h.hexdigest()]
    return digests


def write_checksum(step_dir: Path) -> None:
    """Seals a finished step: its files' digests, written to a temporary name, flushed to
    the disk, then renamed (a reader sees the whole checksum or none)."""
    digests = _file_digests(step_dir)
    tmp = step_dir / (CHECKSUM + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": digests}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / CHECKSUM)


def verify(step_dir: Path) -> str | None:
    """None if ``step_dir`` holds exactly the files its checksum lists, with their sizes
    and contents; else what is wrong, in a few words."""
    try:
        expected = json.loads((step_dir / CHECKSUM).read_text())["files"]
    except FileNotFoundError:
        return "no checksum: its write did not finish, or an earlier train.py wrote it"
    except (OSError, ValueError, KeyError, TypeError):
        return "its checksum file is unreadable"
    if not isinstance(expected, dict):  # e.g. {"files": []}: not what write_checksum writes
        return "its checksum file is unreadable"
    try:
        found = _file_digests(step_dir)
    except OSError as e:
        return f"a file cannot be read ({e.strerror}: {e.filename})"
    for rel, listed in expected.items():
        if not (isinstance(listed, list) and len(listed) == 2 and isinstance(listed[0], int)):
            return "its checksum file is unreadable"
        size, digest = listed
        if rel not in found:
            return f"{rel} is missing"
        if found[rel][0] != size:
            return f"{rel} has {found[rel][0]:,} bytes, {size:,} when written"
        if found[rel][1] != digest:
            return f"{rel} differs from its checksum"
    extra = sorted(set(found) - set(expected))
    return f"{extra[0]} was not part of it" if extra else None


def write_problem(error: BaseException) -> str:
    """What went wrong in a write, in a few words: a full disk, a read-only or forbidden
    directory, else the error's first line. orbax reports a full disk as tensorstore's
    ``RESOURCE_EXHAUSTED``, so the text is searched as well as the errno."""
    chain, e = [], error
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    codes = {getattr(e, "errno", None) for e in chain}
    text = " ".join(str(e) for e in chain)
    if errno.ENOSPC in codes or "No space left on device" in text:
        return "the disk is full (No space left on device)"
    if errno.EROFS in codes or "Read-only file system" in text:
        return "the file system is read-only"
    if errno.EACCES in codes or "Permission denied" in text:
        return "permission denied"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return first[:200]


def check_writable(directory: Path) -> None:
    """Creates ``directory`` and a file in it, then removes the file; raises
    ``CheckpointError`` naming the problem. orbax meets an unwritable directory only in
    its writer threads, which retry for minutes."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints in {directory}: {write_problem(e)}"
                              ) from None


class _QuietWriterErrors(logging.Filter):
    """Keeps orbax's own error logs of a failed write (a traceback per writer thread, on
    stderr through absl) out of the output: the failure reaches the training loop as an
    exception, which ``Checkpoints`` reports in one line. Other logs pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def _manager_class():
    import orbax.checkpoint as ocp

    class Manager(ocp.CheckpointManager):
        """orbax's manager, told the agreed stop (see the module doc)."""

        stop_step: int | None = None

        def reached_preemption(self, step: int) -> bool:
            return step == self.stop_step

    return Manager


class Checkpoints:
    """One run's checkpoints; restores into the live shardings.

    ``main``: this process writes the checksums (process 0; the others only wait and
    delete along, orbax's deletion being collective).
    """

    def __init__(self, directory: Path, keep: int, every: int, main: bool = True):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.directory = directory.resolve()
        self.keep, self.main = keep, main
        self.intact: set[int] = set()     # steps sealed by this run or verified
        self._unsealed: int | None = None  # the step orbax is writing or has just written
        policies = [ocp.checkpoint_managers.PreemptionCheckpointingPolicy()]
        if every:
            policies.insert(0, ocp.checkpoint_managers.FixedIntervalPolicy(every))
        options = ocp.CheckpointManagerOptions(
            create=True, cleanup_tmp_directories=True,
            save_decision_policy=ocp.checkpoint_managers.AnySavePolicy(policies))
        self.manager = _manager_class()(self.directory, options=options)
        self._quiet = _QuietWriterErrors()
        logging.getLogger("absl").addFilter(self._quiet)

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def find_intact(self) -> tuple[int | None, list[tuple[int, str]]]:
        """``(step, damaged)``: the newest step whose files match its checksum (None if
        none does), and ``(step, what is wrong)`` for each newer one. Reads only."""
        damaged = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            problem = verify(self.directory / str(step))
            if problem is None:
                return step, damaged
            damaged.append((step, problem))
        return None, damaged

    def set_aside(self, damaged: list[tuple[int, str]]) -> list[Path]:
        """Renames each damaged step ``damaged-<step>``: kept to look at, out of orbax's
        sight (one process does it). Returns the new paths."""
        moved = []
        for step, _ in damaged:
            aside, n = self.directory / f"{DAMAGED}{step}", 1
            while aside.exists():  # damaged before, in an earlier run
                n += 1
                aside = self.directory / f"{DAMAGED}{step}-{n}"
            (self.directory / str(step)).rename(aside)
            moved.append(aside)
        return moved

    def adopt(self, step: int) -> None:
        """Continues from the intact ``step``: orbax re-reads the directory (without the
        steps set aside), and the steps up to ``step`` count as intact."""
        self.manager.reload()
        self.intact = {s for s in self.manager.all_steps() if s <= step}

    def save(self, step: int, params, opt_state, meta: dict, *, stop: bool = False,
             force: bool = False) -> bool:
        """Saves when the policy says so (every ``every`` steps, ``stop``: the agreed stop)
        or ``force``; returns whether a save started. ``opt_state`` may be a callable
        that makes the tree to write (called only when a save starts)."""
        ocp = self.ocp
        if stop:
            self.manager.stop_step = step
        # Wait first: orbax's should_save says no while a write is in flight, and with the
        # previous write done a second Ctrl-C can only lose the one being written.
        self.wait()  # (orbax would wait too, in a blocking join)
        if self.manager.latest_step() == step or not (force or self.manager.should_save(step)):
            return False
        if callable(opt_state):
            opt_state = opt_state()
        with self._reporting(step):
            started = self.manager.save(step, force=True, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta)))
        if started:
            self._unsealed = step
        return started

    def _reporting(self, step: int):
        """A context that turns a failed write of ``step`` into ``CheckpointError``."""
        @contextlib.contextmanager
        def reporting():
            try:
                yield
            except Exception as e:
                raise CheckpointError(
                    f"the checkpoint of step {step} could not be written to {self.directory}: "
                    f"{write_problem(e)}; {self._kept()}") from None

        return reporting()

    def _kept(self) -> str:
        """What a failed write leaves to resume from, as found on disk now (the folder
        may have gone with the error's cause)."""
        for step in sorted(self.intact, reverse=True):
            if (self.directory / str(step) / CHECKSUM).is_file():
                return f"the checkpoint of step {step} is kept (--resume continues from it)"
        if not self.intact:
            return "no earlier checkpoint: a new start begins from step 0"
        if not self.directory.is_dir():
            return (f"{self.directory} is gone, and with it every checkpoint: a new start "
                    f"begins from step 0")
        return "no checkpoint is left: a new start begins from step 0"

    def _seal(self) -> None:
        """After a write: its checksum, then the steps beyond ``keep`` older than it."""
        step, self._unsealed = self._unsealed, None
        if step is None:
            return
        with self._reporting(step):
            # Re-raises what orbax's writer threads met (the write is over: no wait here).
            self.manager.wait_until_finished()
            if self.main:
                write_checksum(self.directory / str(step))
        self.intact.add(step)
        newest = sorted(self.intact, reverse=True)[: self.keep]
        for old in self.manager.all_steps():
            if old < newest[-1]:
                self.manager.delete(old)
                self.intact.discard(old)

    def meta(self, step: int) -> dict:
        ocp = self.ocp
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return restored["meta"]

    def restore(self, step: int, abstract_params, abstract_state):
        """``(params, opt_state)`` of ``step``, placed as the abstract targets' shardings say."""
        ocp = self.ocp
        r = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params),
            opt_state=ocp.args.StandardRestore(abstract_state)))
        return r["params"], r["opt_state"]

    def wait(self) -> None:
        """Waits for the write in flight, in short sleeps rather than a blocking join, then
        seals it.

        Python runs signal handlers in the main thread, between bytecodes. A signal that
        the OS hands to one of orbax's or XLA's threads is noticed only when the main
        thread runs Python again: during a blocking join, a second Ctrl-C would wait for
        the write it is meant to abort.
        """
        while self.manager.is_saving_in_progress():
            time.sleep(0.05)
        self._seal()

    def close(self) -> None:
        """Waits for the last write and seals it, then releases the manager."""
        try:
            self.wait()
        except CheckpointError:
            with contextlib.suppress(Exception):  # the error said it already
                self.manager.close()
            raise
        finally:
            logging.getLogger("absl").removeFilter(self._quiet)
        self.manager.close()
