"""The GPT example's checkpoints fail loudly: checksummed, verified on --resume, a damaged
newest one set aside for the newest intact one, a failed write reported as what it is.

One tiny run (``pristine``: steps 2 and 4 checkpointed) is trained once; each test
damages a copy of it. Damage is found by ``Checkpoints.find_intact`` (no training) and,
for one flipped byte and for a full disk, through ``train.main`` as the user meets it.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

import checkpoints  # noqa: E402
import memory  # noqa: E402
import train  # noqa: E402

TINY = ["--depth", "1", "--seq-len", "16", "--batch-size", "2", "--steps", "4",
        "--eval-batches", "1", "--eval-every", "0", "--ckpt-every", "2", "--no-progress"]



def run(out, corpus, *extra):
    return train.main([*TINY, "--data", str(corpus), "--out", str(out), *map(str, extra)])


def log_of(out):
    records = [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("pristine")
    assert run(out, corpus) == 0
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["2", "4"]
    assert all(checkpoints.verify(out / "ckpt" / step) is None for step in ("2", "4"))
    return out


@pytest.fixture
def copy(pristine, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(pristine, out)
    return out


def largest_data_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(step_dir: Path) -> None:
    for child in step_dir.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


DAMAGE = {
    "flipped byte": (lambda d: flip_byte(largest_data_file(d)), "differs from its checksum"),
    "truncated": (lambda d: truncate(largest_data_file(d)), "when written"),
    "deleted file": (lambda d: largest_data_file(d).unlink(), "is missing"),
    "emptied": (empty, "no checksum"),
    "no checksum": (lambda d: (d / checkpoints.CHECKSUM).unlink(), "no checksum"),
    "garbled checksum": (lambda d: (d / checkpoints.CHECKSUM).write_text('{"files": {"a": 1}}'),
                         "its checksum file is unreadable"),
    "checksum of a list": (lambda d: (d / checkpoints.CHECKSUM).write_text('{"files": []}'),
                           "its checksum file is unreadable"),
    "null checksum": (lambda d: (d / checkpoints.CHECKSUM).write_text("null"),
                      "its checksum file is unreadable"),
    "null files": (lambda d: (d / checkpoints.CHECKSUM).write_text('{"files": null}'),
                   "its checksum file is unreadable"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damage_to_the_newest_checkpoint_is_found(copy, kind):
    damage, words = DAMAGE[kind]
    damage(copy / "ckpt" / "4")
    ckpts = checkpoints.Checkpoints(copy / "ckpt", keep=2, every=0)
    step, damaged = ckpts.find_intact()
    ckpts.close()
    assert step == 2 and [s for s, _ in damaged] == [4]
    assert words in damaged[0][1], damaged


def test_a_flipped_byte_resumes_from_the_newest_intact_checkpoint(copy, corpus, pristine,
                                                                  capsys):
    flip_byte(largest_data_file(copy / "ckpt" / "4"))
    assert run(copy, corpus, "--resume", "--steps", "4") == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint of step 4 is damaged" in err[0], err
    assert "differs from its checksum" in err[0] and "resuming from step 2" in err[0]
    assert (copy / "ckpt" / "damaged-4").is_dir()             # kept to look at
    assert log_of(copy) == log_of(pristine)                   # steps 3 and 4 again, the same
    assert sorted(p.name for p in (copy / "ckpt").iterdir()) == ["2", "4", "damaged-4"]


def test_no_intact_checkpoint_is_refused_in_one_line(copy, corpus, capsys):
    flip_byte(largest_data_file(copy / "ckpt" / "4"))
    (copy / "ckpt" / "2" / checkpoints.CHECKSUM).unlink()
    assert run(copy, corpus, "--resume") == train.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: --resume: no intact"), err
    assert "step 4:" in err[0] and "step 2: no checksum" in err[0]
    status = json.loads((copy / "config.json").read_text())["status"]
    assert status.startswith("failed: --resume: no intact checkpoint"), status
    assert sorted(p.name for p in (copy / "ckpt").iterdir()) == ["2", "4"]   # untouched


class DiskFull:
    """orbax's manager whose write of step 4 fails as tensorstore reports ENOSPC (the
    message as orbax 0.12.8 gave it on a full tmpfs)."""

    error = ValueError('RESOURCE_EXHAUSTED: Error writing "x0_lambdas.value/0" in OCDBT '
                       'database at local file "ckpt/4.orbax-checkpoint-tmp/params/": Failed '
                       'to write 107008 bytes to file 5: No space left on device '
                       "[os_error_code='28']")

    @classmethod
    def patch(cls, monkeypatch):
        real = checkpoints._manager_class()

        class Manager(real):
            failed = False

            def save(self, step, *args, **kwargs):
                if step == 4:
                    self.failed = True
                    return True
                return super().save(step, *args, **kwargs)

            def wait_until_finished(self):  # where orbax re-raises its writer's error
                if self.failed:
                    raise cls.error
                return super().wait_until_finished()

        monkeypatch.setattr(checkpoints, "_manager_class", lambda: Manager)


def test_a_full_disk_is_reported_as_such_and_keeps_the_last_checkpoint(
        tmp_path, corpus, pristine, monkeypatch, capsys):
    assert memory.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))
    assert not memory.is_out_of_memory(DiskFull.error)
    DiskFull.patch(monkeypatch)
    assert run(tmp_path, corpus) == train.EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: the checkpoint of step 4"), err
    assert "the disk is full" in err[0] and "checkpoint of step 2 is kept" in err[0]
    assert "memory" not in err[0]
    status = json.loads((tmp_path / "config.json").read_text())["status"]
    assert status.startswith("failed: the checkpoint of step 4 could not be written"), status
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2"]
    monkeypatch.undo()
    assert run(tmp_path, corpus, "--resume") == 0             # the disk has room again
    assert log_of(tmp_path) == log_of(pristine)


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write into: one without write permission, or for
    root (whom permissions do not stop) /sys."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return locked
    if os.access("/sys", os.W_OK) and not _probe_fails(Path("/sys")):
        pytest.skip("no directory here refuses root's writes")
    return Path("/sys")


def _probe_fails(path: Path) -> bool:
    try:
        checkpoints.check_writable(path)
    except checkpoints.CheckpointError:
        return True
    return False


def test_an_unwritable_checkpoint_directory_is_refused_before_training(copy, corpus, tmp_path,
                                                                       capsys):
    target = _unwritable_dir(tmp_path)
    assert _probe_fails(target)
    shutil.rmtree(copy / "ckpt")
    (copy / "ckpt").symlink_to(target, target_is_directory=True)
    assert run(copy, corpus, "--resume") == train.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write checkpoints in" in err[0], err


def test_a_file_where_the_checkpoints_go_is_refused_with_resume(copy, corpus, capsys):
    shutil.rmtree(copy / "ckpt")
    (copy / "ckpt").write_text("not a directory")
    assert run(copy, corpus, "--resume") == train.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file, not a checkpoint directory" in err[0], err


def test_data_rewritten_in_place_is_refused_on_resume(tmp_path, corpus, capsys):
    text = tmp_path / "corpus.txt"
    text.write_bytes(corpus.read_bytes())
    out = tmp_path / "out"
    argv = [*TINY, "--data", str(text), "--out", str(out), "--steps", "2"]
    assert train.main(argv) == 0
    changed = bytearray(text.read_bytes())
    changed[100] = ord("#") if changed[100] != ord("#") else ord("%")
    text.write_bytes(bytes(changed))                          # same path, same size
    capsys.readouterr()
    assert train.main([*argv, "--resume"]) == train.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was written on other data: 40000 bytes, sha256" in err[0], err
    assert "restore the data, or start afresh without --resume" in err[0]


def test_a_log_cut_by_a_crash_is_resumed_without_its_last_line(copy, corpus, pristine, capsys):
    """A kill or a full disk leaves log.jsonl's last line cut: --resume drops it, says so
    in one line, and the log ends as an uninterrupted run's."""
    shutil.rmtree(copy / "ckpt" / "4")                        # the crash came before it
    log = copy / "log.jsonl"
    data = log.read_bytes()
    log.write_bytes(data[: len(data) - 25])                   # step 4's record, cut
    assert run(copy, corpus, "--resume") == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the last line of" in err[0] and "was cut off" in err[0], err
    assert "resuming from step 2" in err[0]
    assert log_of(copy) == log_of(pristine)


def test_a_log_damaged_before_its_end_is_refused_in_one_line(copy, corpus, capsys):
    log = copy / "log.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:1] + ["{not json\n"] + lines[1:]))
    assert run(copy, corpus, "--resume") == train.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 2 is not a log record" in err[0], err


class FailedSave:
    """orbax's manager whose write of step 4 fails after ``before(directory)`` ran, as
    orbax reports it (at the next wait)."""

    @staticmethod
    def patch(monkeypatch, error, before=lambda directory: None):
        real = checkpoints._manager_class()

        class Manager(real):
            failed = False

            def save(self, step, *args, **kwargs):
                if step == 4:
                    before(Path(self.directory))
                    self.failed = True
                    return True
                return super().save(step, *args, **kwargs)

            def wait_until_finished(self):
                if self.failed:
                    raise error
                return super().wait_until_finished()

        monkeypatch.setattr(checkpoints, "_manager_class", lambda: Manager)


def test_a_full_disk_that_also_refuses_config_json_is_one_line(tmp_path, corpus, monkeypatch,
                                                               capsys):
    import report

    FailedSave.patch(monkeypatch, DiskFull.error)
    real_write = report.write_json

    def write_json(path, value):
        if str(value.get("status", "")).startswith("failed"):
            raise OSError(28, "No space left on device", str(path) + ".tmp")
        real_write(path, value)

    monkeypatch.setattr(report, "write_json", write_json)
    assert run(tmp_path, corpus) == train.EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint of step 2 is kept" in err[0], err
    assert 'config.json still says "running" (the disk is full' in err[0]


def test_out_removed_mid_run_does_not_claim_a_checkpoint_is_kept(tmp_path, corpus,
                                                                 monkeypatch, capsys):
    out = tmp_path / "out"
    FailedSave.patch(monkeypatch, FileNotFoundError(2, "No such file or directory"),
                     before=lambda directory: shutil.rmtree(out))
    assert run(out, corpus) == train.EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: the checkpoint of step 4"), err
    assert "is kept" not in err[0] and "is gone, and with it every checkpoint" in err[0]
    assert 'config.json still says "running"' in err[0] and "is gone)" in err[0]


@pytest.mark.parametrize("resume", [False, True])
def test_a_symlink_loop_where_the_checkpoints_go_is_one_line(copy, corpus, capsys, resume):
    shutil.rmtree(copy / "ckpt")
    (copy / "ckpt").symlink_to(copy / "ckpt")
    assert run(copy, corpus, *(["--resume"] if resume else [])) == train.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a symbolic link that leads nowhere" in err[0], err


def test_a_fresh_start_empties_a_linked_checkpoint_directory(copy, corpus, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(copy / "ckpt", elsewhere)
    (copy / "ckpt").symlink_to(elsewhere, target_is_directory=True)
    assert run(copy, corpus, "--steps", "2") == 0
    assert (copy / "ckpt").is_symlink() and sorted(p.name for p in elsewhere.iterdir()) == ["2"]


def test_a_full_disk_under_the_log_is_one_line(tmp_path, corpus, monkeypatch, capsys):
    """log.jsonl's write of step 3 meets a full disk: one line, status 1, config.json
    says so, and --resume continues from the checkpoint of step 2."""
    import report

    class FullAfter:
        """log.jsonl opened for appending, whose fourth write (step 3) finds no space."""

        def __init__(self, path, mode, buffering=-1):
            self.file, self.writes = open(path, mode, buffering=buffering), 0

        def write(self, data):
            self.writes += 1
            if self.writes == 4:
                raise OSError(28, "No space left on device")
            return self.file.write(data)

        def close(self):
            self.file.close()

    monkeypatch.setattr(report, "open", FullAfter, raising=False)
    assert run(tmp_path, corpus) == train.EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the record of step 3 could not be written to" in err[0], err
    assert "the disk is full" in err[0] and "--resume continues" in err[0]
    status = json.loads((tmp_path / "config.json").read_text())["status"]
    assert status.startswith("failed: the record of step 3"), status
    monkeypatch.undo()
    assert run(tmp_path, corpus, "--resume") == 0
    assert [r["step"] for r in log_of(tmp_path)] == [0, 1, 2, 3, 4]
