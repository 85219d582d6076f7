"""The agent's log route is one contract (rendezvous.node_logs): what the coordinator
sends is what the agent's server parses."""

from __future__ import annotations

from urllib.parse import urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rendezvous.keys import InvalidIdentifierError
from rendezvous.node_logs import (
    MAX_RANK,
    MAX_TAIL,
    LogQuery,
    log_proof,
    logs_path,
    parse_log_query,
)


@given(rank=st.none() | st.integers(0, MAX_RANK), tail=st.none() | st.integers(0, MAX_TAIL),
       follow=st.booleans(), after=st.integers(0, 2**62))
def test_a_query_the_coordinator_builds_is_parsed_back_unchanged(rank, tail, follow, after):
    sent = LogQuery(job_id="train-0123abcd", rank=rank, tail=tail, follow=follow,
                    after_generation=after)
    got = parse_log_query(f"{sent.path()}?{urlencode(sent.params())}")
    assert got == sent


def test_the_path_refuses_a_job_id_that_is_not_an_id():
    with pytest.raises(InvalidIdentifierError):
        logs_path("../etc")


def test_the_proof_depends_on_the_token_and_the_nonce():
    assert log_proof("t", "n") == log_proof("t", "n")
    assert log_proof("t", "n") != log_proof("t", "m")
    assert log_proof("t", "n") != log_proof("u", "n")
