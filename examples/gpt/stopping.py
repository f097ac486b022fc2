"""The agreed stop: SIGINT or SIGTERM on any process stops every process after the same step.

One process: a signal handler sets a flag; the training loop reads it after every step,
writes a checkpoint and stops.

Several processes (``--distributed``): every process must stop after the same step, or
the ones that go on wait forever in the next step's collectives for the ones that
stopped. jax's distributed runtime has the mechanism for preemption, and this module only
routes signals into it:

* its preemption notifier owns SIGTERM: it tells the coordination service, which tells
  every process; then ``multihost_utils.reached_preemption_sync_point(step)``, called
  after every step, returns True on all processes at the same step (one past the
  furthest step any process had reached) -- this module installs no SIGTERM handler of
  its own there;
* SIGINT (Ctrl-C) is recorded and forwarded as a SIGTERM to this process, so a Ctrl-C
  reaching one process stops them all the same way;
* after the stop the processes share what each of them received
  (``multihost_utils.process_allgather``), so that all exit with one status: 130 if any
  process got SIGINT, else 143 (SIGTERM).

A second signal while stopping (e.g. Ctrl-C during the checkpoint write) ends the process
at once, from the handler (:func:`abort`), with that signal's status: no checkpoint of
this step; the temporary
folder of an unfinished write is removed when the next run opens the checkpoints (orbax's
``cleanup_tmp_directories``).

Limits of jax's protocol, as used here: it places the stop one past the furthest step
any process has reported. A run reports its start step before it compiles
(``register``), but a SIGTERM that arrives earlier still (while a resumed run sets up),
or between the two runs of ``--compare adamw``, is placed at a step the running loop
never reaches; that run goes on as if no signal had come. A SIGINT is never lost: the
process that got it reports it when the run ends (``agreed_status``).

jax is imported lazily: ``train.py`` imports this module before jax may be imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_SIGINT = 130   # 128 + SIGINT, what shells report for Ctrl-C
EXIT_SIGTERM = 143  # 128 + SIGTERM
SIGNAL_NAMES = {EXIT_SIGINT: "SIGINT", EXIT_SIGTERM: "SIGTERM"}


ABORT_MESSAGE = ("\ntrain.py: aborted by a second signal: no checkpoint of this step (the next "
                 "start removes an unfinished one); --resume continues from the last complete "
                 "checkpoint\n")


def abort(status: int = EXIT_SIGINT) -> None:
    """A second signal: one line, then exit at once with ``status`` (the second signal's:
    130 for SIGINT, 143 for SIGTERM, so a scheduler's requeue on 143 still fires),
    without finishing the step or the checkpoint.

    Not an exception: raised in the main thread wherever it is, it would unwind through
    orbax's writer, whose clean-up may join the thread of the very write being aborted
    and wait for it (a test saw a process hang there under load). ``os._exit`` leaves
    orbax's threads where they are; the next start removes what they left.
    """
    sys.stdout.flush()
    sys.stderr.write(ABORT_MESSAGE)
    sys.stderr.flush()
    os._exit(status)


class StopSignals:
    """Context manager: SIGINT/SIGTERM handlers for the training loop (see the module doc).

    ``received`` is the exit status of the first signal this process's handlers saw (0:
    none). ``reached(step)`` says whether to stop after ``step``, the same on every
    process; ``agreed_status(stopped)`` is the exit status all processes share.
    """

    def __init__(self, distributed: bool):
        self.distributed = distributed
        self.received = 0
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        status = EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM
        if self.received:
            abort(status)
        self.received = status
        sys.stderr.write(f"\ntrain.py: {SIGNAL_NAMES[self.received]} received: stopping after "
                         "this step with a checkpoint (a second signal aborts at once)\n")
        sys.stderr.flush()
        if self.distributed:
            # jax's preemption notifier catches SIGTERM and starts the agreement.
            os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            # With --distributed, SIGTERM belongs to jax's notifier (installed by
            # jax.distributed.initialize): a Python handler would replace it.
            signums = [signal.SIGINT] if self.distributed else [signal.SIGINT, signal.SIGTERM]
            for signum in signums:
                self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc) -> bool:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        return False

    def register(self, step: int) -> None:
        """Tells jax's sync protocol the step a run starts from, before its slow compile.

        The protocol places the stop one past the furthest step reported. Reporting the
        start early keeps a SIGTERM that arrives while a resumed run compiles from being
        placed at a step that run has already passed.
        """
        self.reached(step)

    def reached(self, step: int) -> bool:
        """Whether to stop after ``step``: the same answer on every process at that step.

        All processes must call it after every step, with the same ``step``.
        """
        if self.distributed:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return bool(self.received)

    def agreed_status(self, stopped: bool) -> tuple[int, list[int]]:
        """``(status, received per process)``: 130 if any process got SIGINT, else 143 if
        the run stopped or any process got SIGTERM, else 0.

        Collective with ``--distributed``: every process calls it at the same point.
        """
        received = [self.received]
        if self.distributed:
            import numpy as np
            from jax.experimental import multihost_utils

            gathered = multihost_utils.process_allgather(np.asarray([self.received], np.int32))
            received = [int(x) for x in np.asarray(gathered).reshape(-1)]
        if EXIT_SIGINT in received:
            return EXIT_SIGINT, received
        if stopped or EXIT_SIGTERM in received:
            return EXIT_SIGTERM, received
        return 0, received
