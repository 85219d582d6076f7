"""gRPC errors into tidal's etcd errors, in one place (rendezvous.etcd.translate; no etcd)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from rendezvous.errors import (
    EtcdAuthError,
    EtcdError,
    EtcdNoSpaceError,
    EtcdUnavailableError,
    LeaseExpiredError,
)
from rendezvous.etcd.config import EtcdConfig
from rendezvous.etcd.translate import (
    TokenRejectedError,
    is_endpoint_fault,
    is_silence,
    translate_rpc_error,
    was_not_delivered,
)

Code = grpc.StatusCode
PLAIN = EtcdConfig(endpoints=["10.0.0.1:2379", "10.0.0.2:2379"], timeout_s=5)


class RpcError(grpc.RpcError):
    """What a failed gRPC call raises: a code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def translate(
    code: grpc.StatusCode, details: str, config: EtcdConfig = PLAIN, used: str | None = None
) -> EtcdError:
    return translate_rpc_error(
        "get /k", RpcError(code, details), config=config, used=used, timeout_s=1.5
    )


@pytest.mark.parametrize(
    ("code", "details", "kind"),
    [
        (Code.UNAUTHENTICATED, "etcdserver: invalid auth token", TokenRejectedError),
        (Code.INVALID_ARGUMENT, "etcdserver: revision of auth store is old", TokenRejectedError),
        (Code.INVALID_ARGUMENT, "etcdserver: authentication failed, invalid user ID or password",
         EtcdAuthError),
        (Code.FAILED_PRECONDITION, "etcdserver: authentication is not enabled", EtcdAuthError),
        (Code.PERMISSION_DENIED, "etcdserver: permission denied", EtcdAuthError),
        (Code.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded", EtcdNoSpaceError),
        (Code.NOT_FOUND, "etcdserver: requested lease not found", LeaseExpiredError),
        (Code.UNAVAILABLE, "failed to connect to all addresses", EtcdUnavailableError),
        (Code.DEADLINE_EXCEEDED, "Deadline Exceeded", EtcdUnavailableError),
        (Code.CANCELLED, "Cancelled", EtcdUnavailableError),
    ],
)
def test_each_kind_of_failure_becomes_its_error(
    code: grpc.StatusCode, details: str, kind: type[EtcdError]
) -> None:
    assert type(translate(code, details)) is kind


def test_anything_else_is_a_plain_etcd_error_naming_the_code() -> None:
    error = translate(Code.INTERNAL, "boom")
    assert type(error) is EtcdError
    assert str(error) == (
        "etcd at 10.0.0.1:2379, 10.0.0.2:2379: get /k failed (StatusCode.INTERNAL): boom"
    )


def test_an_unanswered_call_names_the_member_it_went_to_and_the_deadline() -> None:
    error = translate(Code.DEADLINE_EXCEEDED, "Deadline Exceeded", used="10.0.0.2:2379")
    assert str(error) == (
        "etcd at 10.0.0.2:2379 did not answer get /k within 1.5 s: Deadline Exceeded"
    )


def test_a_refused_handshake_without_a_client_certificate_says_so(tmp_path: Path) -> None:
    config = EtcdConfig(endpoints=["10.0.0.1:2379"], ca_cert=tmp_path / "ca.pem")
    error = translate(Code.UNAVAILABLE, "Ssl handshake failed: TSI_DATA_CORRUPTED", config)
    assert type(error) is EtcdAuthError
    assert "requires a client certificate and none was given" in str(error)


def test_a_server_certificate_for_another_host_says_so() -> None:
    error = translate(Code.UNAVAILABLE, "Peer name 10.0.0.1 is not in peer certificate")
    assert type(error) is EtcdAuthError
    assert "does not name the host" in str(error)


def test_only_a_request_that_never_reached_a_member_counts_as_not_delivered() -> None:
    assert was_not_delivered(translate(Code.UNAVAILABLE, "failed to connect to all addresses"))
    assert not was_not_delivered(translate(Code.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert not was_not_delivered(EtcdError("Connection refused"))


def test_silence_and_refusal_are_told_apart() -> None:
    assert is_silence(RpcError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert is_silence(RpcError(Code.UNAVAILABLE, "keepalive watchdog timeout"))
    assert not is_silence(RpcError(Code.UNAVAILABLE, "Connection refused"))
    assert is_endpoint_fault(RpcError(Code.INTERNAL, "boom"))
    assert not is_endpoint_fault(RpcError(Code.INVALID_ARGUMENT, "etcdserver: too many operations"))
