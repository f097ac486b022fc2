"""orbax checkpoints of the GPT example: ``ckpt/<step>/{params,opt_state,meta}``.

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
from pathlib import Path


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
        or ``force``; returns whether a save started."""
        ocp = self.ocp
        if stop:
            self.manager.stop_step = step
        self.wait()  # orbax would wait for the previous write too, in a blocking join
        if self.manager.latest_step() == step:
            return False
        return self.manager.save(step, force=force, args=ocp.args.Composite(
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
