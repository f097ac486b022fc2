"""The GPT example's agreed stop, in real processes on localhost.

Each test starts ``examples/gpt/train.py`` with ``subprocess`` on a tiny config (depth 1,
batches of 2 x 16 bytes, a 40 KB corpus), sends signals with ``os.kill`` once the run's
``log.jsonl`` shows that training is under way, and kills every child that is still
running when the test ends or a timeout passes.

* SIGTERM to a single process: a checkpoint, status 143, and ``--resume`` repeats the
  loss sequence of an uninterrupted run bit for bit;
* two processes (``--distributed``, gloo on localhost), SIGINT to process 1 only: both
  stop after the same step with one checkpoint and status 130 within 120 s, and resume
  (in the other mode: the ZeRO-2 checkpoint continues with ``--fsdp``);
* a second SIGINT while the checkpoint is being written (a wrapper slows orbax's final
  rename down): one line, no traceback, status 130; the next start removes the
  unfinished folder and resumes from the last complete checkpoint.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from localhost import free_port, gloo_available

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "gpt" / "train.py"
STEPS = 40
TINY = ["--depth", "1", "--seq-len", "16", "--batch-size", "2", "--steps", str(STEPS),
        "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "0", "--no-progress"]
RUN_TIMEOUT_S = 180   # one process, start to end, on a busy 2-core machine
STOP_TIMEOUT_S = 120  # from the signal to every process's exit
PAIR_STEPS = 400      # a two-process run long enough that a signal always lands mid-run
SAVE_STEPS = 12       # the second signal's runs: checkpoints of steps 3, 6, 9 and 12
# XLA's quick compile: these tests check the control flow, not the speed of the step.
FAST_XLA = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]


def _env(cache_dir):
    """The children's environment; ``cache_dir=None`` runs without jax's persistent cache."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + FAST_XLA)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache_dir is not None:
        # One compilation cache for the module's single processes: a resumed run loads the
        # train step instead of compiling it again.
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env



class Processes:
    """Children of one test; ``close`` kills whatever still runs."""

    def __init__(self, tmp_path, cache_dir):
        self.tmp_path, self.cache_dir = tmp_path, cache_dir
        self.procs = []

    def start(self, name, *args, script=TRAIN):
        log = open(self.tmp_path / f"{name}.txt", "w")
        # --distributed processes too: where loading a multi-process program from it hangs
        # (jaxlib 0.12.1, CPU), train.py turns the cache off (CI's newest leg checks that).
        env = _env(self.cache_dir)
        proc = subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO)
        proc.name, proc.log = name, self.tmp_path / f"{name}.txt"
        self.procs.append(proc)
        return proc

    def output(self, proc):
        return proc.log.read_text()

    def wait(self, procs, timeout):
        """Exit codes of ``procs``; fails (with their output) unless all exit in time."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        if any(p.poll() is None for p in procs):
            self.close()
            pytest.fail(f"still running after {timeout} s:\n{self.report(procs)}")
        return [p.returncode for p in procs]

    def until(self, condition, procs, timeout, what):
        """Polls ``condition()`` until true; fails if a process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while not condition():
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                self.close()
                pytest.fail(f"never saw {what}:\n{self.report(procs)}")
            time.sleep(0.05)

    def report(self, procs):
        return "\n".join(f"--- {p.name} (exit {p.poll()}):\n{self.output(p)[-3000:]}"
                         for p in procs)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture
def procs(tmp_path, cache_dir):
    p = Processes(tmp_path, cache_dir)
    yield p
    p.close()


def logged_steps(out):
    path = Path(out) / "log.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def read_log(out):
    with open(Path(out) / "log.jsonl") as f:
        return [json.loads(line) for line in f]


def math_of(log):
    """The records without the timings: what must repeat exactly."""
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in log]


def checkpoints(out):
    ckpt = Path(out) / "ckpt"
    return sorted(p.name for p in ckpt.iterdir()) if ckpt.exists() else []


def test_sigterm_then_resume_equals_an_uninterrupted_run(procs, tmp_path, corpus):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    common = [*TINY, "--data", corpus]
    run = procs.start("cut", *common, "--out", cut)
    procs.until(lambda: logged_steps(cut) >= 3, [run], RUN_TIMEOUT_S, "two steps")
    config = json.loads((cut / "config.json").read_text())  # written at the start
    assert config["status"] == "running" and config["warmup_steps"] == 4
    os.kill(run.pid, signal.SIGTERM)
    assert procs.wait([run], STOP_TIMEOUT_S) == [143], procs.report([run])
    stopped_at = int(checkpoints(cut)[-1])
    assert checkpoints(cut) == [str(stopped_at)] and 2 <= stopped_at < STEPS
    assert f"interrupted (SIGTERM): checkpoint of step {stopped_at}" in procs.output(run)
    assert json.loads((cut / "config.json").read_text())["status"] == "stopped (SIGTERM)"

    # The uninterrupted run starts now, to load the steps the cut one compiled.
    resumed = procs.start("resumed", *common, "--out", cut, "--resume")
    reference = procs.start("whole", *common, "--out", whole)
    assert procs.wait([resumed, reference], RUN_TIMEOUT_S) == [0, 0], procs.report(
        [resumed, reference])
    assert f"(step {stopped_at})" in procs.output(resumed)
    assert math_of(read_log(cut)) == math_of(read_log(whole))  # bitwise the same run


def _start_pair(procs, name, out, corpus, *extra):
    port = free_port()
    return [procs.start(f"{name}{i}", *TINY, "--data", corpus, "--out", out, "--distributed",
                        "--devices", "2", "--coordinator", f"127.0.0.1:{port}",
                        "--num-processes", "2", "--process-id", i, "--batch-size", 4, *extra)
            for i in range(2)]


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_sigint_to_one_of_two_processes_stops_both_at_one_step(procs, tmp_path, corpus):
    # A pair's tiny steps take milliseconds: 40 of them can all be done before the
    # agreement on a SIGINT reaches both processes. Both halves run PAIR_STEPS, so the
    # signal always lands mid-run (a resume refuses a changed step count).
    out, steps = tmp_path / "out", ["--steps", PAIR_STEPS]
    pair = _start_pair(procs, "first", out, corpus, *steps)
    procs.until(lambda: logged_steps(out) >= 3, pair, RUN_TIMEOUT_S, "two steps")
    os.kill(pair[1].pid, signal.SIGINT)
    assert procs.wait(pair, STOP_TIMEOUT_S) == [130, 130], procs.report(pair)
    stopped_at = int(checkpoints(out)[-1])
    assert checkpoints(out) == [str(stopped_at)] and 2 <= stopped_at < PAIR_STEPS
    assert "interrupted (SIGINT on process 1)" in procs.output(pair[0])
    assert read_log(out)[-1]["step"] == stopped_at
    # The module's persistent cache is set for every child: where loading from it hangs
    # (jaxlib 0.12.1 and later on CPU) train.py turns it off, and says so; elsewhere not.
    import jaxlib
    hangs = tuple(int(x) for x in jaxlib.__version__.split(".")[:3] if x.isdigit()) >= (0, 12, 1)
    said = "persistent compilation cache is off for this run" in procs.output(pair[0])
    assert said == hangs, procs.output(pair[0])

    # Resumed under FSDP, and stopped again from the other process a few steps on (the
    # resume runs to the end in test_sigterm_then_resume_equals_an_uninterrupted_run).
    pair = _start_pair(procs, "again", out, corpus, *steps, "--resume", "--fsdp")
    procs.until(lambda: logged_steps(out) >= stopped_at + 4, pair, RUN_TIMEOUT_S,
                "three resumed steps")
    os.kill(pair[0].pid, signal.SIGINT)
    assert procs.wait(pair, STOP_TIMEOUT_S) == [130, 130], procs.report(pair)
    assert (f"(step {stopped_at}; written on 4 devices in 2 processes (ZeRO-2), continued on "
            f"4 devices in 2 processes (FSDP))") in procs.output(pair[0])
    assert "interrupted (SIGINT on process 0)" in procs.output(pair[0])
    kept = sorted(int(c) for c in checkpoints(out))     # by number: "13" sorts before "4"
    again = kept[-1]
    assert kept == [stopped_at, again] and stopped_at < again < PAIR_STEPS
    assert [r["step"] for r in read_log(out)] == list(range(again + 1))


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_a_killed_peer_ends_the_other_in_one_line(procs, tmp_path, corpus):
    """kill -9 of process 1: process 0's next collective fails; it says so in one line
    and exits 1 at once (jax's shutdown would wait minutes for the dead peer)."""
    out = tmp_path / "out"
    pair = _start_pair(procs, "pair", out, corpus, "--steps", PAIR_STEPS, "--ckpt-every", 2)
    procs.until(lambda: logged_steps(out) >= 3, pair, RUN_TIMEOUT_S, "two steps")
    pair[1].kill()
    assert procs.wait(pair[:1], STOP_TIMEOUT_S) == [1], procs.report(pair[:1])
    text = procs.output(pair[0])
    errors = [line for line in text.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and "lost contact with process 1 (" in errors[0], text
    assert "restart every process with --resume" in errors[0] and "Traceback" not in text


# Runs train.py with orbax's final rename of a step's checkpoint held back (a slow
# filesystem): saves of steps above SLOW_AFTER never complete on their own.
SLOW_SAVES = """
import asyncio, runpy, sys
from orbax.checkpoint._src.path import atomicity

SLOW_AFTER = int(sys.argv.pop(1))
original = atomicity.AtomicRenameTemporaryPath.finalize

async def finalize(self, *args, **kwargs):
    name = self.get_final().name
    if name.isdigit() and int(name) > SLOW_AFTER:
        await asyncio.sleep(3600)
    return await original(self, *args, **kwargs)

atomicity.AtomicRenameTemporaryPath.finalize = finalize
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_second_signal_during_a_save_aborts_cleanly(procs, tmp_path, corpus, signum, status):
    """A second SIGTERM exits 143 like the first would (a requeue keyed on 143 fires)."""
    out, wrapper = tmp_path / "out", tmp_path / "slow_saves.py"
    wrapper.write_text(SLOW_SAVES.format(train=str(TRAIN)))
    # SAVE_STEPS, not STEPS: the first run cannot end by itself (each save waits for the
    # one before, and step 6's never finishes), and the resume writes 4 checkpoints, not 13.
    common = [*TINY, "--data", corpus, "--out", out, "--ckpt-every", "3",
              "--steps", SAVE_STEPS]
    run = procs.start("slow", 3, *common, script=wrapper)
    procs.until(lambda: logged_steps(out) >= 6, [run], RUN_TIMEOUT_S, "five steps")
    os.kill(run.pid, signum)
    # Two signals that arrive before Python runs the handler are one: wait until it has.
    procs.until(lambda: f"{signal.Signals(signum).name} received: stopping" in procs.output(run),
                [run], STOP_TIMEOUT_S, "the first signal handled")

    def unfinished():
        ckpt = out / "ckpt"
        return ckpt.exists() and any("tmp" in p.name for p in ckpt.iterdir())

    procs.until(unfinished, [run], STOP_TIMEOUT_S, "a checkpoint being written")
    os.kill(run.pid, signum)
    assert procs.wait([run], STOP_TIMEOUT_S) == [status], procs.report([run])
    text = procs.output(run)
    assert text.count("aborted by a second signal") == 1 and "Traceback" not in text, text
    assert "3" in checkpoints(out) and unfinished()

    resumed = procs.start("resumed", *common, "--resume")
    assert procs.wait([resumed], RUN_TIMEOUT_S) == [0], procs.report([resumed])
    assert "(step 3)" in procs.output(resumed)
    assert not unfinished() and str(SAVE_STEPS) in checkpoints(out)
    assert [r["step"] for r in read_log(out)] == list(range(SAVE_STEPS + 1))


def test_distributed_off_a_cluster_is_one_line(procs, tmp_path, corpus):
    run = procs.start("alone", *TINY, "--data", corpus, "--out", tmp_path / "out",
                      "--distributed")
    assert procs.wait([run], RUN_TIMEOUT_S) == [2], procs.report([run])
    text = procs.output(run)
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("train.py: error: --distributed: "), text
    assert "Traceback" not in text and "--coordinator" in errors[0]


def test_a_peer_that_never_starts_ends_the_wait_in_one_line(procs, tmp_path, corpus):
    run = procs.start("lonely", *TINY, "--data", corpus, "--out", tmp_path / "out",
                      "--distributed", "--coordinator", f"127.0.0.1:{free_port()}",
                      "--num-processes", "2", "--process-id", "0", "--init-timeout", "3")
    assert procs.wait([run], RUN_TIMEOUT_S) == [2], procs.report([run])
    text = procs.output(run)
    assert "waiting up to 3 s, --init-timeout" in text
    assert "train.py: error: not every process joined within 3 s" in text, text
    assert "no process holds --process-id 1 in" in text, text
    assert "Traceback" not in text


def _in_process(argv, capsys):
    """``train.main(argv)`` in this process: (status, its error lines)."""
    if str(TRAIN.parent) not in sys.path:  # as the other in-process tests import it
        sys.path.insert(0, str(TRAIN.parent))
    import train
    capsys.readouterr()
    status = train.main([str(a) for a in argv])
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_second_run_on_one_out_is_refused_and_a_killed_one_holds_nothing(procs, tmp_path,
                                                                             corpus, capsys):
    """Two runs on one --out: the second (fresh or --resume) is refused in one line naming
    the first; the first's log stays its own. kill -9 of the first frees the folder."""
    out = tmp_path / "out"
    common = [*TINY, "--data", corpus, "--out", out, "--ckpt-every", 2]
    first = procs.start("first", *common)
    procs.until(lambda: logged_steps(out) >= 3, [first], RUN_TIMEOUT_S, "two steps")
    for extra in ([], ["--resume"]):
        status, err = _in_process([*common, *extra], capsys)
        assert status == 2 and len(err) == 1, err
        assert err[0].startswith(f"train.py: error: --out {out} is in use by another run: "
                                 f"pid {first.pid} on host "), err
    first.kill()
    first.wait()
    steps = [r["step"] for r in read_log(out)]
    assert steps == list(range(len(steps)))                   # one run's lines only
    resumed = procs.start("resumed", *common, "--resume")
    assert procs.wait([resumed], RUN_TIMEOUT_S) == [0], procs.report([resumed])
    assert [r["step"] for r in read_log(out)] == list(range(STEPS + 1))


def test_a_duplicate_process_id_is_named_by_both(procs, tmp_path, corpus):
    """Two processes given --process-id 0: the second is refused at once, and the first
    stops waiting for the missing process 1, naming the duplicate (no jax abort)."""
    out, port = tmp_path / "out", free_port()
    pair = [procs.start(f"dup{i}", *TINY, "--data", corpus, "--out", out, "--distributed",
                        "--coordinator", f"127.0.0.1:{port}", "--num-processes", 2,
                        "--process-id", 0, "--init-timeout", 60) for i in range(2)]
    assert procs.wait(pair, RUN_TIMEOUT_S) == [2, 2], procs.report(pair)
    errors = sorted([line for line in procs.output(p).splitlines() if "error" in line]
                    for p in pair)
    assert [len(e) for e in errors] == [1, 1], procs.report(pair)
    refused, waiting = sorted(e[0] for e in errors)
    assert refused.startswith("train.py: error: --process-id 0 is taken in --out"), refused
    assert "give each of the 2 processes its own --process-id" in refused
    assert "--process-id 0 was given to two processes of this run" in waiting, waiting
    assert "Traceback" not in procs.report(pair)


def test_a_lock_taken_a_moment_before_names_its_holder(tmp_path):
    """Two processes started at once: the second can find the first's lock held but still
    empty (taken, not yet written); it reads it again and names the holder."""
    if str(TRAIN.parent) not in sys.path:
        sys.path.insert(0, str(TRAIN.parent))
    import outlock

    run = {"coordinator": "127.0.0.1:1", "num_processes": 2}
    first = outlock.OutLock(tmp_path, 0, run, ["--process-id", "0"])
    fd = os.open(outlock.lock_path(tmp_path, 0), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    writer = threading.Timer(0.3, os.write, (fd, json.dumps(first.info).encode()))
    writer.start()
    try:
        with pytest.raises(outlock.FolderBusy, match=rf"--process-id 0 is taken in --out .*: "
                                                     rf"pid {os.getpid()} on host "):
            outlock.OutLock(tmp_path, 0, run, ["--process-id", "0"]).acquire()
    finally:
        writer.join()
        os.close(fd)


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_processes_started_with_other_settings_refuse_naming_them(procs, tmp_path, corpus):
    """Process 1 with another --seed and --steps: both refuse at the start in the same
    line, naming both flags and each process's value (they would train on mismatched
    batches, or hang at the step where one stops)."""
    port = free_port()
    pair = [procs.start(f"p{i}", *TINY, "--data", corpus, "--out", tmp_path / "out",
                        "--distributed", "--devices", 1, "--coordinator", f"127.0.0.1:{port}",
                        "--num-processes", 2, "--process-id", i, *extra)
            for i, extra in enumerate([[], ["--seed", 7, "--steps", 10]])]
    assert procs.wait(pair, RUN_TIMEOUT_S) == [2, 2], procs.report(pair)
    lines = [[line for line in procs.output(p).splitlines() if "error" in line] for p in pair]
    assert lines[0] == lines[1] and len(lines[0]) == 1, procs.report(pair)
    assert "--seed (process 0: 0, process 1: 7)" in lines[0][0], lines[0]
    assert "--steps (process 0: 40, process 1: 10)" in lines[0][0], lines[0]
