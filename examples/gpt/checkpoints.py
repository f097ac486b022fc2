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

* ``max_to_keep``: the last ``--keep-ckpts`` checkpoints stay;
* ``save_decision_policy``: a save every ``--ckpt-every`` steps, and one at the agreed
  stop (jax's preemption sync point in a multi-process run, see ``stopping.py``);
* ``cleanup_tmp_directories``: the temporary folder of a write that was interrupted
  (``<step>.orbax-checkpoint-tmp-*``) is removed when the next run opens the directory;
  ``latest_step`` never sees it, so ``--resume`` takes the last complete checkpoint.

Saves are asynchronous: the training loop goes on while orbax writes, and ``close``
waits for the last write.

The manager is told the agreed stop (``save(..., stop=True)``) instead of asking jax's
sync point itself: orbax asks ``reached_preemption(step)`` also from the thread that
finishes an asynchronous save, and that would report an older step to jax's sync
protocol while training is already further on. The protocol keeps the last step each
process reported, so it could place the stop at a step the loop has passed, and nobody
would stop. The training loop alone asks jax, once per step.
"""

from __future__ import annotations

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


def _manager_class():
    import orbax.checkpoint as ocp

    class Manager(ocp.CheckpointManager):
        """orbax's manager, told the agreed stop (see the module doc)."""

        stop_step: int | None = None

        def reached_preemption(self, step: int) -> bool:
            return step == self.stop_step

    return Manager


class Checkpoints:
    """One run's checkpoints; restores into the live shardings."""

    def __init__(self, directory: Path, keep: int, every: int):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.directory = directory.resolve()
        policies = [ocp.checkpoint_managers.PreemptionCheckpointingPolicy()]
        if every:
            policies.insert(0, ocp.checkpoint_managers.FixedIntervalPolicy(every))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=True,
            save_decision_policy=ocp.checkpoint_managers.AnySavePolicy(policies))
        self.manager = _manager_class()(self.directory, options=options)

    def latest(self) -> int | None:
        return self.manager.latest_step()

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
        return self.manager.save(step, force=True, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))

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
        """Waits for the write in flight, in short sleeps rather than a blocking join.

        Python runs signal handlers in the main thread, between bytecodes. A signal that
        the OS hands to one of orbax's or XLA's threads is noticed only when the main
        thread runs Python again: during a blocking join, a second Ctrl-C would wait for
        the write it is meant to abort.
        """
        while self.manager.is_saving_in_progress():
            time.sleep(0.05)

    def close(self) -> None:
        """Waits for the last write, then releases the manager."""
        self.wait()
        self.manager.wait_until_finished()
        self.manager.close()
