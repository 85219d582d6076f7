"""The key layout and the validation of identifiers that become part of keys."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rendezvous.keys import DEFAULT_ROOT, InvalidIdentifierError, Keys, validate_id, validate_root


@pytest.mark.parametrize("good", ["job-1", "a", "node_3.example", "A" * 63, "0abc"])
def test_validate_id_accepts_safe_names(good: str) -> None:
    assert validate_id(good) == good


@pytest.mark.parametrize(
    "bad",
    [
        "",
        ".",
        "..",
        "../etc",
        "a/b",
        "/abs",
        "-leading-dash",
        ".hidden",
        "A" * 64,
        "job 1",
        "jöb",
        "ジョブ",
        "job\n1",
        "job\x00",
    ],
)
def test_validate_id_rejects_unsafe_names_with_a_message_naming_the_value(bad: str) -> None:
    with pytest.raises(InvalidIdentifierError) as info:
        validate_id(bad, what="job id")
    assert "job id" in str(info.value)
    assert repr(bad) in str(info.value)


def test_validate_id_rejects_non_strings() -> None:
    with pytest.raises(InvalidIdentifierError, match="must be a string, not int"):
        validate_id(3)  # type: ignore[arg-type]


def test_invalid_identifier_is_a_value_error() -> None:
    # Callers that validate user input (the HTTP API) catch ValueError -> 422.
    assert issubclass(InvalidIdentifierError, ValueError)


@pytest.mark.parametrize("bad", ["tidal", "/tidal/", "/", "/a/../b", "/a//b", "//x"])
def test_validate_root_rejects_malformed_roots(bad: str) -> None:
    with pytest.raises(InvalidIdentifierError):
        validate_root(bad)


def test_keys_rejects_a_bad_root() -> None:
    with pytest.raises(InvalidIdentifierError, match="must start with '/'"):
        Keys("tidal")


def test_layout_under_the_default_root() -> None:
    keys = Keys()
    assert keys.root == DEFAULT_ROOT == "/tidal"
    assert keys.job("j1") == "/tidal/jobs/j1"
    assert keys.node("n1") == "/tidal/nodes/n1"
    assert keys.assignment("n1", "j1") == "/tidal/assignments/n1/j1"
    assert keys.status("j1", "n1") == "/tidal/status/j1/n1"
    assert keys.event("j1", 7) == "/tidal/events/j1/000000000007"
    assert keys.rdzv_state("j1") == "/tidal/rdzv/j1/state"
    assert keys.rdzv_store_prefix("j1") == "/tidal/rdzv/j1/store/"
    assert keys.election_candidate("coord", 0xAB) == "/tidal/election/coord/00000000000000ab"


def test_every_key_lives_under_a_custom_root() -> None:
    keys = Keys("/tidal-test/x")
    built = [
        keys.job("j"),
        keys.node("n"),
        keys.assignment("n", "j"),
        keys.status("j", "n"),
        keys.event("j", 0),
        keys.rdzv_state("j"),
        keys.election_candidate("e", 1),
    ]
    assert all(key.startswith("/tidal-test/x/") for key in built)


def test_prefixes_end_in_a_slash_so_job_1_never_matches_job_10() -> None:
    keys = Keys()
    prefixes = {
        "status": (keys.job_status_prefix("job-1"), keys.status("job-10", "n")),
        "events": (keys.job_events_prefix("job-1"), keys.event("job-10", 0)),
        "rdzv": (keys.rdzv_prefix("job-1"), keys.rdzv_state("job-10")),
        "assignments": (keys.node_assignments_prefix("node-1"), keys.assignment("node-10", "j")),
        "election": (keys.election_prefix("e-1"), keys.election_candidate("e-10", 1)),
    }
    for name, (prefix, other_key) in prefixes.items():
        assert prefix.endswith("/"), name
        assert not other_key.startswith(prefix), name
    assert not keys.job("job-10").startswith(keys.job("job-1") + "/")
    assert keys.jobs_prefix() == "/tidal/jobs/" and keys.nodes_prefix() == "/tidal/nodes/"


def test_event_keys_sort_in_numeric_order() -> None:
    keys = Keys()
    seqs = [0, 1, 9, 10, 99, 100, 123456]
    assert sorted(keys.event("j", s) for s in seqs) == [keys.event("j", s) for s in seqs]


def test_event_rejects_a_negative_sequence_number() -> None:
    with pytest.raises(ValueError, match=r"event sequence number \(-1\) must be >= 0"):
        Keys().event("j", -1)


@pytest.mark.parametrize(
    "build",
    [
        lambda k: k.job("../x"),
        lambda k: k.node("a/b"),
        lambda k: k.assignment("n", ".."),
        lambda k: k.status("", "n"),
        lambda k: k.rdzv_state("x" * 64),
        lambda k: k.election_prefix("é"),
    ],
)
def test_builders_validate_the_identifiers_they_embed(build) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidIdentifierError):
        build(Keys())


def test_a_key_is_parsed_back_to_its_id_or_to_none() -> None:
    keys = Keys("/t")
    assert keys.node_of(keys.node("n-1")) == "n-1"
    assert keys.drained_node(keys.drain("n-1")) == "n-1"
    for other in (keys.drain("n-1"), "/t/nodes/", "/t/nodes/a/b", "/t/nodes/../x", "/u/nodes/a",
                  "/t/nodes-extra/a"):
        assert keys.node_of(other) is None, other


@given(st.text(max_size=80))
def test_parsing_never_raises_and_only_returns_what_the_builder_accepts(suffix: str) -> None:
    keys = Keys("/t")
    parsed = keys.node_of(keys.nodes_prefix() + suffix)
    assert parsed is None or keys.node(parsed) == keys.nodes_prefix() + suffix
