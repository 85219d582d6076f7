"""Tables that fit the terminal, labelled values that wrap, and where the width comes from."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.cli.output import cut, fit_widths, labelled, table, terminal_width

HEADERS = ["JOB", "PHASE", "COMMAND"]
ROWS: list[list[object]] = [
    ["train-0123abcd", "RUNNING", "python train.py --lr 0.1 --batch-size 4096 --epochs 90"],
    ["eval-89abcdef", "PENDING", None],
]


def test_a_table_that_fits_is_left_as_it_was() -> None:
    text = table(HEADERS, ROWS, shrink=["COMMAND"], width=200)
    assert text.splitlines()[1] == ("train-0123abcd  RUNNING  python train.py --lr 0.1 "
                                    "--batch-size 4096 --epochs 90")
    assert text.splitlines()[2] == "eval-89abcdef   PENDING  -"
    assert table(HEADERS, ROWS, shrink=["COMMAND"], width=None) == text


def test_a_wide_table_cuts_only_its_free_text_columns_to_the_width() -> None:
    lines = table(HEADERS, ROWS, shrink=["COMMAND"], width=50).splitlines()
    assert max(len(line) for line in lines) == 50
    assert lines[1] == "train-0123abcd  RUNNING  python train.py --lr 0.1…"
    assert lines[0].split() == HEADERS


def test_ids_are_never_cut_even_when_the_table_cannot_fit() -> None:
    lines = table(HEADERS, ROWS, shrink=["COMMAND"], width=20).splitlines()
    assert lines[1].startswith("train-0123abcd  RUNNING  python …")  # COMMAND kept at 8
    assert "train-0123abcd" in lines[1] and "eval-89abcdef" in lines[2]


def test_space_is_taken_from_the_widest_shrinkable_column_first() -> None:
    assert fit_widths([10, 40, 20], [3, 8, 8], [1, 2], width=54) == [10, 20, 20]
    assert fit_widths([10, 40, 20], [3, 8, 8], [1, 2], width=44) == [10, 15, 15]
    assert fit_widths([10, 40, 20], [3, 8, 8], [2], width=54) == [10, 40, 8]
    assert fit_widths([10, 40, 20], [3, 8, 8], [1, 2], width=None) == [10, 40, 20]


@given(st.lists(st.integers(1, 60), min_size=1, max_size=6), st.integers(10, 200),
       st.data())
def test_fitted_widths_fit_when_they_can_and_never_go_below_a_floor(
    natural: list[int], width: int, data: st.DataObject,
) -> None:
    floors = [min(n, 8) for n in natural]
    shrinkable = data.draw(st.lists(st.sampled_from(range(len(natural))), unique=True))
    widths = fit_widths(natural, floors, shrinkable, width)
    assert all(f <= w <= n for f, w, n in zip(floors, widths, natural, strict=True))
    assert all(widths[i] == natural[i] for i in range(len(natural)) if i not in shrinkable)
    gaps = 2 * (len(natural) - 1)
    least = sum(natural[i] if i not in shrinkable else floors[i] for i in range(len(natural)))
    assert sum(widths) + gaps <= max(width, least + gaps)


def test_cut_ends_in_an_ellipsis() -> None:
    assert (cut("abcdef", 6), cut("abcdef", 4), cut("abcdef", 1)) == ("abcdef", "abc…", "…")


def test_labelled_values_align_and_wrap_under_themselves(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # pytest-xdist's workers have it set
    pairs = [("job", "train-0123abcd"),
             ("command", "python train.py " + " ".join(f"--flag-{i} {i}" for i in range(8)))]
    lines = labelled(pairs, width=40)
    assert lines[0] == "job:      train-0123abcd"
    assert lines[1].startswith("command:  python train.py --flag-0 0")
    assert all(len(line) <= 40 for line in lines)
    assert all(line.startswith(" " * 10) for line in lines[2:]) and len(lines) > 3
    assert labelled(pairs, width=None)[1] == f"command:  {pairs[1][1]}"


def test_the_width_is_columns_else_the_terminal_else_none(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv("COLUMNS", "73")
    assert terminal_width(io.StringIO()) == 73
    monkeypatch.setenv("COLUMNS", "wide")
    assert terminal_width(io.StringIO()) is None  # a pipe or a file is never cut
    monkeypatch.delenv("COLUMNS")
    assert terminal_width(io.StringIO()) is None


def test_every_job_and_node_command_that_prints_data_takes_json() -> None:
    from service.cli.jobs import COMMANDS

    assert [c.name for c in COMMANDS if not any(p.name == "as_json" for p in c.params)] == []
