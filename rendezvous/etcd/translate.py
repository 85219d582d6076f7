"""gRPC's errors, translated once into :mod:`rendezvous.errors`.

Every call of the etcd layer fails with a ``grpc.RpcError`` (pyetcd's own
exception classes are never raised: the facade calls gRPC stubs directly).
:func:`translate_rpc_error` is the one place that turns one into an
:class:`~rendezvous.errors.EtcdError`, with a message that names the call, the
endpoint and, for a refused TLS handshake, the problem (no client
certificate, the wrong CA, a server certificate that does not name the host).
The rest of this module classifies errors for the facade's retry policy
(:func:`was_not_delivered`) and for endpoint picking (:func:`is_endpoint_fault`,
:func:`is_silence`). Pure functions: no I/O.
"""

from __future__ import annotations

import grpc

from rendezvous.errors import (
    EtcdAuthError,
    EtcdError,
    EtcdNoSpaceError,
    EtcdUnavailableError,
    LeaseExpiredError,
)
from rendezvous.etcd.config import EtcdConfig

# gRPC details that mean the request never reached a member (safe to resend).
NOT_DELIVERED = ("failed to connect to all addresses", "Connection refused", "No route to host")
# etcd no longer accepts the token we hold: get a new one and retry (what
# etcd's own Go client does). Simple tokens live in the memory of the member
# and die with it; JWT tokens expire; a change of users or roles outdates both.
TOKEN_REJECTED = ("invalid auth token", "revision of auth store is old")
# etcd answers these with INVALID_ARGUMENT or FAILED_PRECONDITION, not UNAUTHENTICATED.
AUTH_REFUSED = ("authentication failed", "authentication is not enabled", "user name is empty")

# gRPC codes that blame the endpoint: it is unreachable, silent or broken.
ENDPOINT_FAULTS = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
)
# UNAVAILABLE details that mean "no answer" rather than "refused": gRPC's
# keep-alive gave up on a connection whose packets vanish, or the deadline
# ended a TCP handshake that got no reply.
SILENT_DETAILS = ("timed out", "keepalive watchdog timeout", "handshaker shutdown")


class TokenRejectedError(EtcdAuthError):
    """etcd refused our auth token (not our user): authenticating again fixes it."""


def _code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    return exc.code() if hasattr(exc, "code") else None


def _details(exc: grpc.RpcError) -> str:
    return (exc.details() if hasattr(exc, "details") else str(exc)) or ""


def is_endpoint_fault(exc: grpc.RpcError) -> bool:
    """True if ``exc`` blames the endpoint the call went to (unreachable, silent, broken)."""
    return _code(exc) in ENDPOINT_FAULTS


def is_silence(exc: grpc.RpcError) -> bool:
    """True if ``exc`` says the endpoint did not answer (rather than refused)."""
    if _code(exc) == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    detail = (exc.details() or "").lower() if hasattr(exc, "details") else ""
    return any(sign in detail for sign in SILENT_DETAILS)


def was_not_delivered(exc: EtcdError) -> bool:
    """True if the call that raised ``exc`` never reached a member: resending is safe."""
    return isinstance(exc, EtcdUnavailableError) and any(
        marker in str(exc) for marker in NOT_DELIVERED
    )


def tls_problem(detail: str, config: EtcdConfig) -> str | None:
    """A sentence naming what went wrong in a TLS handshake with etcd, from gRPC's
    error details; None when they show no TLS failure (etcd merely unreachable)."""
    text = detail.lower()
    if "hostname verification" in text or "peer name" in text:
        return (
            "etcd's server certificate does not name the host it was reached at: "
            "add that name or IP address to the certificate's subject alternative names"
        )
    if "certificate_verify_failed" in text:
        return (
            f"etcd's server certificate could not be verified with the CA in {config.ca_cert}: "
            "is that the CA that signed it, and is the certificate still valid?"
        )
    if config.secure and any(
        sign in text for sign in ("bad_certificate", "certificate_required", "tsi_data_corrupted")
    ):
        # TLS 1.3: etcd checks the client certificate after the client's half of
        # the handshake, so its refusal arrives as a corrupt first record.
        if config.cert_cert is None:
            return (
                "etcd closed the TLS connection: it requires a client certificate and none "
                "was given (--etcd-cert and --etcd-key, or TIDAL_ETCD_CERT and TIDAL_ETCD_KEY)"
            )
        return (
            f"etcd refused the client certificate {config.cert_cert}: is it signed by a CA "
            "in etcd's --trusted-ca-file, and still valid?"
        )
    return None


def translate_rpc_error(
    what: str,
    exc: grpc.RpcError,
    *,
    config: EtcdConfig,
    used: str | None,
    timeout_s: float,
) -> EtcdError:
    """The :mod:`rendezvous.errors` error for a failed etcd call.

    Args:
        what: the call, for the message ("get /tidal/jobs/j1").
        exc: what gRPC raised.
        config: the client's configuration (endpoints and TLS files, for the message).
        used: the endpoint the call went to, if known.
        timeout_s: the call's deadline, for the message.

    Returns:
        :class:`TokenRejectedError` (authenticate again and retry),
        :class:`EtcdAuthError`, :class:`EtcdNoSpaceError`,
        :class:`LeaseExpiredError`, :class:`EtcdUnavailableError`, or a plain
        :class:`EtcdError` for anything else.
    """
    code = _code(exc)
    detail = _details(exc)
    where = ", ".join(config.endpoints)
    if any(reason in detail for reason in TOKEN_REJECTED):
        return TokenRejectedError(f"etcd at {where} refused {what}: {detail}")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or any(
        reason in detail for reason in AUTH_REFUSED
    ):
        return EtcdAuthError(f"etcd at {where} refused {what}: {detail}")
    tls = tls_problem(detail, config) if code == grpc.StatusCode.UNAVAILABLE else None
    if tls is not None:
        return EtcdAuthError(f"etcd at {where}: {what} failed: {tls} ({detail})")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "space" in detail:
        return EtcdNoSpaceError(f"etcd at {where} is out of space: {detail}")
    if "lease not found" in detail:
        return LeaseExpiredError(f"{what}: the lease has expired or was revoked")
    if code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    ):
        return EtcdUnavailableError(
            f"etcd at {used or where} did not answer {what} within {timeout_s:g} s: {detail}"
        )
    return EtcdError(f"etcd at {where}: {what} failed ({code}): {detail}")


__all__ = [
    "TokenRejectedError",
    "is_endpoint_fault",
    "is_silence",
    "tls_problem",
    "translate_rpc_error",
    "was_not_delivered",
]
