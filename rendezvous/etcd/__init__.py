"""tidal's etcd layer, one module per seam.

* :mod:`rendezvous.etcd.types`: the plain values calls take and return (``KeyValue``,
  ``Compare``, ``Put``, ``Delete``, ``Get``, ``TxnResult``, watch events); no grpc.
* :mod:`rendezvous.etcd.config`: ``EtcdConfig``, how to reach etcd.
* :mod:`rendezvous.etcd.endpoints`: ``EndpointPicker``, which member the next call goes to.
* :mod:`rendezvous.etcd.translate`: gRPC errors into :mod:`rendezvous.errors`, in one place.
* :mod:`rendezvous.etcd.messages`: the values to and from etcd's protobuf messages.
* :mod:`rendezvous.etcd.transport`: the gRPC channels (a pyetcd subclass) and one call on them.
* :mod:`rendezvous.etcd.facade`: ``EtcdClient`` and ``create_client``: every call
  goes through one path that applies a deadline, translates errors and retries
  what is safe to retry.
* :mod:`rendezvous.etcd.stream`: ``WatchStream``, one watch as a plain iterator.

:mod:`rendezvous.client` re-exports the public names; nothing outside this
package imports pyetcd or grpc.
"""

from __future__ import annotations

#: The etcd layer's logger. It keeps the name it had when the layer was one
#: module, so that log lines (and filters on them) read as before.
LOGGER_NAME = "rendezvous.client"
