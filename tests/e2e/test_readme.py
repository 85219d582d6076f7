"""The README's "Running tidal" commands, run as a new user would type them.

The fenced block is read from README.md, so this test breaks when the README
changes into something that does not work. It runs from the repository root
with a ``PATH`` that does not hold the virtual environment (the user did not
activate it): ``python`` in the job's command must still be tidal's own
interpreter. ``tidal up`` keeps its state in a temporary ``TIDAL_HOME``.

Two changes to the lines as written, both to keep the test bounded and
isolated, neither to what is tested:

* ``--total-steps`` is lowered to :data:`TOTAL_STEPS`: the default model
  takes 3 to 10 s a step on a 2-core CI machine, so 300 steps take many
  minutes; one step goes the same way (start, train, checkpoint, finish);
* a path under ``/tmp`` is moved into the test's own directory, so runs
  never share a checkpoint (a finished one would end the next run at once).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTION = "Running tidal"
TOTAL_STEPS = 1


def readme_commands(text: str, section: str) -> list[list[str]]:
    """The command lines of the first ``bash`` block of ``section``, as argument lists.

    Continuation lines are joined and comments dropped; a trailing ``&``
    stays the last word (the command runs in the background).
    """
    match = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no section {section!r}"
    block = re.search(r"```bash\n(.*?)```", match.group(1), re.S)
    assert block, f"README.md's {section!r} has no bash block"
    joined = block.group(1).replace("\\\n", " ")
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def adapt(words: list[str], tmp: Path) -> list[str]:
    """The two changes the module docstring explains; nothing else."""
    out = []
    for i, word in enumerate(words):
        if i > 0 and words[i - 1] == "--total-steps":
            word = str(TOTAL_STEPS)
        elif word.startswith("/tmp/"):
            word = str(tmp / word.removeprefix("/tmp/"))
        out.append(word)
    return out


def test_the_readme_block_is_what_this_test_expects():
    commands = readme_commands(README.read_text(), SECTION)
    assert commands[0][-1] == "&" and commands[0][1] == "up", commands[0]
    submit = next(c for c in commands if c[1] == "submit")
    command = submit[submit.index("--") + 1:]
    assert command[0] == "python", "the README's job should start with a bare python"


def _environment(home: Path) -> dict[str, str]:
    """This process's environment as a user's shell would have it: no virtual environment."""
    venv_bin = str(ROOT / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("TIDAL_")}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep)
        if p and os.path.realpath(p) != os.path.realpath(venv_bin)
    )
    env["TIDAL_HOME"] = str(home)
    return env


def _wait_up(proc: subprocess.Popen[bytes], log_path: Path, cluster: Path) -> None:
    """Until ``tidal up`` wrote its cluster file and its coordinator is ready."""

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"tidal up exited:\n{log_path.read_text()}")
        if not cluster.exists():
            return False
        url = json.loads(cluster.read_text())["url"]
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200

    wait_for(up, timeout=120, what="tidal up ready")


@pytest.mark.slow  # about 20 s on an idle 2-core machine, 40 s on a busy one
@pytest.mark.timeout(240)
def test_running_tidal_as_the_readme_says(tmp_path: Path, procs: ProcessGroupRegistry):
    home = tmp_path / "home"
    env = _environment(home)
    commands = [adapt(c, tmp_path) for c in readme_commands(README.read_text(), SECTION)]
    background = None
    started = time.monotonic()
    outputs = []
    try:
        for n, words in enumerate(commands):
            log_path = tmp_path / f"command-{n}.log"
            if words[-1] == "&":
                assert background is None, "one command in the background is all this test runs"
                background = procs.spawn(words[:-1], log_path=log_path, env=env, cwd=ROOT)
                _wait_up(background, log_path, home / "cluster.json")
                continue
            proc = procs.spawn(words, log_path=log_path, env=env, cwd=ROOT)
            code = wait_for(lambda proc=proc: proc.poll() is not None and (proc.returncode,),
                            timeout=150, what=f"{shlex.join(words)} to return")[0]
            outputs.append(log_path.read_text())
            assert code == 0, f"{shlex.join(words)} exited with {code}:\n{outputs[-1]}"
        took = time.monotonic() - started
        jobs = outputs[-1]
        assert re.search(r"^lm-\S+\s+SUCCEEDED\b", jobs, re.M), jobs
        print(f"the README's commands took {took:.1f} s")
    finally:
        if background is not None and background.poll() is None:
            # "Ctrl-C stops everything it started"
            background.send_signal(signal.SIGINT)
            try:
                wait_for(lambda: background.poll() is not None, timeout=60,
                         what="tidal up stopping on Ctrl-C")
            finally:
                procs.kill_group(background)
