"""``.ci/run``: the README's test command on both jax lines, with stand-in Pythons.

Each test copies the script into a temporary repository and runs it with a PATH of
stand-ins (shell scripts that answer like ``python3.X``, ``pyenv`` and a venv's ``pip`` and
``python``), so nothing is installed and the real ``.venv`` is never touched.
"""

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("dirname", "rm", "mktemp", "chmod", "sort", "mkdir", "cat")

# A Python of the given version: answers --version and the script's two -c questions; as
# python3 it makes a fake venv (.venv or .venv-tpu, tagged <version> or <version>-tpu)
# whose pip logs the tag, PIP_CONSTRAINT and its arguments, and whose python logs the tag
# and its arguments; its pytest exits with the number in $FAKE/rc_<tag> (0 if absent).
PYTHON = """#!/bin/sh
case "$1" in
  --version) echo "Python {version}" ;;
  -c) case "$2" in *executable*) echo "$0" ;; *) exit {too_old} ;; esac ;;
  -m) mkdir -p "$3/bin"
      tag="{version}${{3#.venv}}"
      printf '#!/bin/sh\\necho "%s ${{PIP_CONSTRAINT:-none}} $*" >> "$FAKE/pip.log"\\n' \\
          "$tag" > "$3/bin/pip"
      printf '#!/bin/sh\\n[ "$1" = - ] && {{ echo "Python {version}, jax fake"; exit 0; }}\\n'\\
'echo "%s $*" >> "$FAKE/python.log"\\n[ "$2" = pytest ] || exit 0\\n'\\
'exit $(cat "$FAKE/rc_%s" 2>/dev/null || echo 0)\\n' "$tag" "$tag" > "$3/bin/python"
      chmod +x "$3/bin/pip" "$3/bin/python" ;;
esac
"""


def _script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def fake_python(path: Path, version: str) -> None:
    too_old = int(tuple(int(re.match(r"\d+", v)[0]) for v in version.split(".")[:2]) < (3, 12))
    _script(path, PYTHON.format(version=version, too_old=too_old))


@pytest.fixture
def repo(tmp_path):
    """A repository holding .ci/, a bin/ of the tools the script uses and a python3 3.11."""
    shutil.copytree(ROOT / ".ci", tmp_path / "repo" / ".ci")
    for tool in TOOLS:
        (tmp_path / "bin").mkdir(exist_ok=True)
        (tmp_path / "bin" / tool).symlink_to(shutil.which(tool))
    fake_python(tmp_path / "bin" / "python3", "3.11.7")
    return tmp_path


def ci(repo: Path, plan_only: bool = True) -> subprocess.CompletedProcess:
    env = {"PATH": str(repo / "bin"), "FAKE": str(repo), "HOME": str(repo)}
    if plan_only:
        env["CI_PLAN_ONLY"] = "1"
    return subprocess.run([shutil.which("bash"), str(repo / "repo" / ".ci" / "run")],
                          env=env, capture_output=True, text=True, timeout=60)


def test_runs_the_readme_test_command_word_for_word():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"# 2\. the tests \(what CI runs\)\n(.+)\n", readme).group(1)
    body = re.search(r"readme_tests\(\) \{.*\n +(.+)\n\}", (ROOT / ".ci" / "run").read_text())
    assert body.group(1) == command


def test_says_it_skips_the_newest_jax_without_python_3_12(repo):
    res = ci(repo)
    assert res.returncode == 0, res.stderr
    assert "oldest leg: jax 0.10.x (.ci/oldest-jax.txt) on python3, Python 3.11.7" in res.stdout
    assert "newest leg: SKIPPED: no Python 3.12 or newer here" in res.stdout


def test_passes_over_a_pyenv_shim_that_does_not_run(repo):
    _script(repo / "bin" / "python3.13", "#!/bin/sh\necho 'pyenv: python3.13: not found' >&2\n"
            "exit 127\n")
    fake_python(repo / "bin" / "python3.12", "3.12.1")
    res = ci(repo)
    assert f"newest leg: the newest jax on {repo}/bin/python3.12, Python 3.12.1" in res.stdout


@pytest.mark.parametrize("on_path", [True, False], ids=["pyenv on PATH", "only ~/.pyenv"])
def test_finds_the_newest_of_pyenvs_versions(repo, on_path):
    root = repo / (".pyenv" if not on_path else "elsewhere")
    for version in ("3.9.18", "3.11.7", "3.12.1", "3.13.0", "3.14.0t", "3.15-dev"):
        fake_python(root / "versions" / version / "bin" / "python3", version)
    if on_path:
        _script(repo / "bin" / "pyenv", f"#!/bin/sh\n[ \"$1\" = root ] && echo {root}\n")
    res = ci(repo)
    assert f"newest leg: the newest jax on {root}/versions/3.13.0/bin/python3, Python 3.13.0" \
        in res.stdout


def summary(res) -> list[str]:
    """The summary's lines of a CI run, less their timings."""
    lines = res.stdout.split("=== summary\n")[1].splitlines()
    return [re.sub(r" in \d+ s$", "", line) for line in lines]


def test_runs_both_legs_and_fails_when_pytest_collects_nothing(repo):
    fake_python(repo / "bin" / "python3.13", "3.13.0")
    (repo / "rc_3.11.7").write_text("5\n")
    res = ci(repo, plan_only=False)
    assert res.returncode == 1, res.stdout + res.stderr
    assert summary(res) == [
        "oldest: Python 3.11.7, jax fake: FAILED: pytest collected no tests (exit 5)",
        "newest: Python 3.13.0, jax fake: passed; TPU compiler tests: passed"]
    pins = (repo / "pip.log").read_text().splitlines()
    assert pins == [f"3.11.7 {repo}/repo/.ci/oldest-jax.txt install -q -e .[test]",
                    "3.13.0 none install -q -e .[test]",
                    "3.13.0-tpu none install -q -e .[test,tpu]"]
    assert "jax==0.10.*" in (repo / "repo" / ".ci" / "oldest-jax.txt").read_text()


def test_newest_leg_runs_the_tpu_tests_in_a_venv_of_their_own_and_fails_with_them(repo):
    fake_python(repo / "bin" / "python3.13", "3.13.0")
    (repo / "rc_3.13.0-tpu").write_text("1\n")
    res = ci(repo, plan_only=False)
    assert res.returncode == 1, res.stdout + res.stderr
    assert summary(res) == [
        "oldest: Python 3.11.7, jax fake: passed",
        "newest: Python 3.13.0, jax fake: passed; TPU compiler tests: FAILED (exit 1)"]
    calls = (repo / "python.log").read_text().splitlines()
    assert calls == ["3.11.7 -m pytest -q -n 2", "3.13.0 -m pytest -q -n 2",
                     "3.13.0-tpu -c import libtpu, flax.nnx",   # else they skip, or fail unnamed
                     "3.13.0-tpu -m pytest -q -p no:xdist tests/test_tpu_compile.py"]
    assert not (repo / "repo" / ".venv-tpu").exists()   # removed after its step
    assert "then the TPU compiler's tests in .venv-tpu" in res.stdout


def test_pyproject_readme_and_ci_name_the_same_oldest_jax_and_python():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest = next(d for d in project["dependencies"] if d.startswith("jax>=")).split()[0][5:]
    python = project["requires-python"].removeprefix(">=")
    assert f"jax=={oldest}.*" in (ROOT / ".ci" / "oldest-jax.txt").read_text().splitlines()
    assert f"Programming Language :: Python :: {python}" in project["classifiers"]
    install = (ROOT / "README.md").read_text().split("## Install\n")[1].split("\n## ")[0]
    assert f"Python {python}+, jax {oldest} or newer" in install
    assert re.search(rf"jax {re.escape(oldest)}\.\d+ on Python {re.escape(python)}\.\d+", install)
