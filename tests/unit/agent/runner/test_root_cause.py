"""A worker's error as the events and `tidal status` show it (agent.runner.elastic.root_cause)."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from agent.runner.elastic import TORCH_NO_ERROR_FILE, error_line, root_cause

TRACEBACK = """\
[W1127 15:30:15.000 ProcessGroupGloo.cpp:12] Warning: something torch prints
Traceback (most recent call last):
  File "/job/train.py", line 12, in <module>
    main()
  File "/job/train.py", line 9, in main
    raise ValueError("learning rate must be positive, got -0.1")
ValueError: learning rate must be positive, got -0.1

"""


def test_the_error_line_is_the_last_exception_line_of_the_output() -> None:
    assert error_line(TRACEBACK) == "ValueError: learning rate must be positive, got -0.1"
    chained = f"{TRACEBACK}\nDuring handling...\ntorch.distributed.DistBackendError: peer gone\n"
    assert error_line(chained) == "torch.distributed.DistBackendError: peer gone"
    assert error_line("KeyboardInterrupt\n") == "KeyboardInterrupt"


def test_without_an_exception_line_it_is_the_last_line_but_torchs_pointer() -> None:
    assert error_line(f"loading data\nout of disk space\n{TORCH_NO_ERROR_FILE} see: x\n") == (
        "out of disk space")
    assert error_line("") == ""
    assert error_line(f"{TORCH_NO_ERROR_FILE} see: https://pytorch.org\n") == ""


def _failure(tmp_path: Path) -> ProcessFailure:
    error_file = tmp_path / "error.json"  # none written: the script has no @record
    return ProcessFailure(local_rank=0, pid=4242, exitcode=1, error_file=str(error_file))


def test_a_failure_without_an_error_file_is_named_by_its_stderr(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.log"
    stderr.write_text(TRACEBACK)
    error = root_cause({3: _failure(tmp_path)}, {0: str(stderr)})
    assert error is not None
    assert error.rank == 3 and error.exit_code == 1
    assert error.message == "ValueError: learning rate must be positive, got -0.1"
    assert "raise ValueError" in error.traceback


def test_with_no_output_at_all_torchs_message_is_kept(tmp_path: Path) -> None:
    error = root_cause({0: _failure(tmp_path)}, {})
    assert error is not None and error.message.startswith(TORCH_NO_ERROR_FILE)
