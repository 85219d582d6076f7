"""The etcd-v3 rendezvous backend and c10d Store for torch.distributed.elastic.

torch ships an ``etcd`` and an ``etcd-v2`` backend, both on etcd's v2 API,
which etcd 3.5 disables by default and 3.6 removed. This module is the v3
equivalent, plugged into torch's own ``DynamicRendezvousHandler``:

* :class:`EtcdV3RendezvousBackend` keeps the rendezvous state in one key and
  implements compare-and-set on that key's mod revision (the token);
* :class:`~rendezvous.elastic.store.EtcdV3Store` is the c10d ``Store`` the handler
  (and the elastic agent's rank assignment and barriers) uses, kept in etcd too, so no agent
  hosts the rendezvous store and killing any node, the first one included,
  cannot take the store down with it;
* :func:`handler_factory` is the ``torchrun.handlers`` entry point, so plain
  ``torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:PORT`` works.

Every key is written under a lease (``key_ttl``, two hours by default, renewed
as the state is rewritten on each heartbeat), so a finished or abandoned
job's rendezvous keys disappear by themselves; :func:`delete_rendezvous`
removes them at once.

Why the state's reads and writes have a deadline of their own: a node is
alive to its peers while its heartbeat, written into the state, is younger
than the liveness window (keep-alive interval x attempts, 5 s by default).
An etcd member cut off from the network does not refuse a call, it swallows
it; a heartbeat waiting on it for the client's whole timeout would outlive
the window, and every peer would drop this node. So a state call waits at
most a fifth of the window (1 s by default, ``etcd_call_timeout``), the
client quarantines the member that did not answer, and the retry goes to
another one. With a single etcd endpoint there is no other member to go to,
and calls keep the client's timeout.

Why TCP-store sharing is turned off: since torch 2.4 the rank-0 agent hosts a
TCPStore shared with its workers and publishes its address only when it first
becomes rank 0. A node that joins a later round then waits for a MASTER_ADDR
that the still-rank-0 survivor never publishes again (observed: both agents
give up after 60 s). With sharing off, each round's rank 0 publishes a fresh
MASTER_ADDR/MASTER_PORT into that round's store, and the workers' own
TCPStore lives and dies with the round.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)

from rendezvous.elastic.store import (
    DEFAULT_KEY_TTL_S,
    DEFAULT_OUTAGE_GRACE_S,
    EtcdV3Store,
    ride_out_outage,
)
from rendezvous.errors import EtcdError
from rendezvous.etcd import (
    Compare,
    EtcdClient,
    EtcdConfig,
    Get,
    Put,
    create_client,
)
from rendezvous.etcd.settings import ETCD_PASSWORD
from rendezvous.keys import DEFAULT_ROOT, Keys, validate_id
from rendezvous.lease import LeaseCache

log = logging.getLogger(__name__)
T = TypeVar("T")

BACKEND_NAME = "etcd-v3"

# Defaults chosen for fast recovery without a fragile rendezvous; see
# docs/architecture.md ("Rendezvous tuning"). torch's own: 5 s x 3 keep-alive,
# 30 s last call.
DEFAULT_RDZV_CONF: dict[str, str] = {
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "5",
    "last_call_timeout": "2",
    "join_timeout": "600",
    "close_timeout": "30",
}
DEFAULT_ETCD_TIMEOUT_S = 10.0
# The first deadline of a rendezvous state call, as a share of the liveness
# window: one attempt, a retry with twice the deadline and the backoff between
# them take at most 3/5 of the window. Never below MIN_CALL_TIMEOUT_S: etcd
# commits a write with an fsync on a majority, which a busy disk slows down.
CALL_TIMEOUT_SHARE = 0.2
MIN_CALL_TIMEOUT_S = 0.5
# torch's own defaults, used when the parameters name no keep-alive settings.
_TORCH_KEEP_ALIVE_INTERVAL_S = 5
_TORCH_KEEP_ALIVE_MAX_ATTEMPT = 3


def liveness_call_timeout(
    keep_alive_interval_s: float, keep_alive_max_attempt: int, etcd_timeout_s: float
) -> float:
    """The deadline of a rendezvous state call for a given liveness window.

    Returns:
        ``CALL_TIMEOUT_SHARE`` of ``interval x attempts``, at least
        ``MIN_CALL_TIMEOUT_S`` and at most ``etcd_timeout_s``.
    """
    window = keep_alive_interval_s * keep_alive_max_attempt
    return min(etcd_timeout_s, max(MIN_CALL_TIMEOUT_S, window * CALL_TIMEOUT_SHARE))


def _rendezvous_error(what: str, exc: EtcdError) -> RendezvousConnectionError:
    return RendezvousConnectionError(f"etcd-v3 rendezvous: {what} failed: {exc}")


class EtcdV3RendezvousBackend(RendezvousBackend):
    """The rendezvous state of one run, in one etcd key, with compare-and-set.

    The token is the key's mod revision as a string. ``set_state`` with no
    token creates the key only if it does not exist; with a token, it writes
    only if the key's mod revision still equals it. Either way it returns the
    state etcd holds afterwards, its token, and whether this write won.

    Args:
        client: the etcd client.
        run_id: the rendezvous (job) id; validated, it becomes part of a key.
        key_ttl_s: lifetime of the state key once nobody rewrites it.
        outage_grace_s: how long a call retries while etcd is unreachable.
        call_timeout_s: the first deadline of each state read or write (then
            doubled at each retry); None: the client's own timeout. Keep it well
            below the liveness window: see the module docstring.
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        *,
        key_ttl_s: int = DEFAULT_KEY_TTL_S,
        outage_grace_s: float = DEFAULT_OUTAGE_GRACE_S,
        call_timeout_s: float | None = None,
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        if call_timeout_s is not None and call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s ({call_timeout_s}) must be positive")
        self._client = client
        self._grace_s = outage_grace_s
        self.call_timeout_s = call_timeout_s
        self._key = client.keys.rdzv_state(validate_id(run_id, what="rendezvous run id"))
        self._leases = LeaseCache(client, key_ttl_s)

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND_NAME

    @property
    def key(self) -> str:
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        try:
            # A read: safe to send again, to any member.
            kv = ride_out_outage(
                "reading the state",
                lambda timeout_s: self._client.get(self._key, timeout_s=timeout_s),
                self._grace_s,
                call_timeout_s=self.call_timeout_s,
            )
        except EtcdError as exc:
            raise _rendezvous_error("reading the state", exc) from exc
        return None if kv is None else (kv.value, str(kv.mod_revision))

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        if token is None:
            expected = 0  # create_revision/mod_revision of an absent key
        else:
            try:
                expected = int(token)
            except (TypeError, ValueError):
                # Not one of our tokens: it cannot match; report the current state.
                current = self.get_state()
                return None if current is None else (*current, False)

        def write(lease: int, timeout_s: float | None) -> Any:
            return self._client.txn(
                [Compare(self._key, "mod", "==", expected)],
                success=[Put(self._key, state, lease=lease), Get(self._key)],
                failure=[Get(self._key)],
                timeout_s=timeout_s,
            )

        # Why resending after an expired deadline is safe, although the first
        # attempt may have been applied: the write is guarded on the mod
        # revision it was computed from, so at most one attempt (or anyone
        # else's write) wins. If an earlier attempt won, the retry's guard
        # fails and etcd returns the current state, which holds our change,
        # with "not written": torch's state holder takes the returned state as
        # the truth and decides again from it, as after losing any race. An
        # attempt applied late wins only if nobody wrote since it was sent,
        # exactly when it would have won on time.
        try:
            result = ride_out_outage(
                "writing the state",
                lambda timeout_s: self._leases.with_lease(
                    lambda lease: write(lease, timeout_s), timeout_s
                ),
                self._grace_s,
                call_timeout_s=self.call_timeout_s,
            )
        except EtcdError as exc:
            raise _rendezvous_error("writing the state", exc) from exc
        kvs = result.gets[0]
        if not kvs:  # deleted between our compare and get: nothing to report
            return None
        return kvs[0].value, str(kvs[0].mod_revision), result.succeeded


def delete_rendezvous(client: EtcdClient, run_id: str) -> int:
    """Delete every key of a run's rendezvous (state and store); returns how many."""
    return client.delete_prefix(client.keys.rdzv_prefix(run_id))


def _etcd_config(params: RendezvousParameters) -> EtcdConfig:
    endpoints = [e.strip() for e in (params.endpoint or "").split(",") if e.strip()]
    if not endpoints:
        raise ValueError("etcd-v3 rendezvous: --rdzv-endpoint must name an etcd HOST:PORT")
    password = os.environ.get(ETCD_PASSWORD)
    return EtcdConfig(
        endpoints=endpoints,
        timeout_s=float(params.get("etcd_timeout", DEFAULT_ETCD_TIMEOUT_S)),
        root=str(params.get("key_root", os.environ.get("TIDAL_ETCD_ROOT", DEFAULT_ROOT))),
        ca_cert=params.get("ca_cert"),
        cert_cert=params.get("ssl_cert"),
        cert_key=params.get("ssl_cert_key"),
        user=params.get("user", os.environ.get("TIDAL_ETCD_USER")),
        password=password,  # type: ignore[arg-type]  # pydantic wraps str in SecretStr
    )


def _call_timeout(params: RendezvousParameters, config: EtcdConfig) -> float | None:
    """``etcd_call_timeout`` from the parameters, or the default for their liveness
    window; None (the client's timeout) by default with a single etcd endpoint."""
    explicit = params.get("etcd_call_timeout")
    if explicit is not None:
        value = float(explicit)
        if value <= 0:
            raise ValueError(f"etcd-v3 rendezvous: etcd_call_timeout ({explicit}) must be positive")
        return min(value, config.timeout_s)
    if len(config.endpoints) < 2:
        return None  # no other member to fail over to: a slow answer is still an answer
    interval = params.get_as_int("keep_alive_interval", _TORCH_KEEP_ALIVE_INTERVAL_S)
    attempts = params.get_as_int("keep_alive_max_attempt", _TORCH_KEEP_ALIVE_MAX_ATTEMPT)
    return liveness_call_timeout(
        float(interval or _TORCH_KEEP_ALIVE_INTERVAL_S),
        attempts or _TORCH_KEEP_ALIVE_MAX_ATTEMPT,
        config.timeout_s,
    )


def create_backend(
    params: RendezvousParameters, *, client: EtcdClient | None = None
) -> tuple[EtcdV3RendezvousBackend, EtcdV3Store]:
    """Create the backend and store of one rendezvous from torchrun's parameters.

    Recognised ``--rdzv-conf`` keys besides torch's own: ``etcd_timeout``
    (seconds per etcd call, default 10), ``etcd_call_timeout`` (first deadline
    of a rendezvous state read or write; by default, with several etcd
    endpoints, a fifth of the liveness window ``keep_alive_interval x
    keep_alive_max_attempt``, at least 0.5 s, and with one the client's own
    timeout: there is no other member to fail over to),
    ``etcd_outage_grace`` (seconds a call retries while etcd is unreachable,
    default 60), ``key_ttl`` (seconds a key outlives its last write, default
    7200), ``key_root`` (default ``/tidal``), ``ca_cert``, ``ssl_cert``,
    ``ssl_cert_key``, ``user`` (password from ``TIDAL_ETCD_PASSWORD``).

    Raises:
        RendezvousConnectionError: etcd cannot be reached.
        ValueError: a parameter is invalid.
    """
    key_ttl = params.get_as_int("key_ttl", DEFAULT_KEY_TTL_S) or DEFAULT_KEY_TTL_S
    grace = float(params.get("etcd_outage_grace", DEFAULT_OUTAGE_GRACE_S))
    if client is None:
        try:
            client = create_client(_etcd_config(params))
        except EtcdError as exc:
            raise RendezvousConnectionError(f"etcd-v3 rendezvous: {exc}") from exc
    keys: Keys = client.keys
    backend = EtcdV3RendezvousBackend(
        client,
        params.run_id,
        key_ttl_s=key_ttl,
        outage_grace_s=grace,
        call_timeout_s=_call_timeout(params, client.config),
    )
    store = EtcdV3Store(
        client, keys.rdzv_store_prefix(params.run_id), key_ttl_s=key_ttl, outage_grace_s=grace
    )
    return backend, store


def create_etcd_v3_handler(
    params: RendezvousParameters, *, client: EtcdClient | None = None
) -> RendezvousHandler:
    """Build torch's DynamicRendezvousHandler on the etcd-v3 backend.

    tidal's defaults (:data:`DEFAULT_RDZV_CONF`) fill in whatever
    ``--rdzv-conf`` leaves out.

    Args:
        params: torchrun's rendezvous parameters.
        client: an etcd client to use (tidal's runner passes its own, built
            with its TLS and credentials); by default one is built from
            ``params``.
    """
    return create_handler_and_backend(params, client=client)[0]


def create_handler_and_backend(
    params: RendezvousParameters, *, client: EtcdClient | None = None
) -> tuple[RendezvousHandler, EtcdV3RendezvousBackend]:
    """Like :func:`create_etcd_v3_handler`, also returning the backend (for its outage record)."""
    for key, value in DEFAULT_RDZV_CONF.items():
        params.config.setdefault(key, value)
    # See the module docstring: each round publishes its own master address.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    backend, store = create_backend(params, client=client)
    return create_handler(store, backend, params), backend


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it and registers the result."""
    return create_etcd_v3_handler


# torch loads the ``torchrun.handlers`` entry points when its rendezvous package
# is first imported. When that first import is the one at the top of this
# module (this module imported before torch's), the entry point names a module
# still half-built, fails to load, and torch only logs a warning: register the
# backend now that the module is complete. The same creator twice is a no-op.
rendezvous_handler_registry.register(BACKEND_NAME, handler_factory())


__all__ = [
    "BACKEND_NAME",
    "DEFAULT_RDZV_CONF",
    "EtcdV3RendezvousBackend",
    "EtcdV3Store",
    "RendezvousStateError",
    "create_backend",
    "create_etcd_v3_handler",
    "create_handler_and_backend",
    "delete_rendezvous",
    "handler_factory",
    "liveness_call_timeout",
]
