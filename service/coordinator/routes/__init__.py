"""The coordinator's HTTP routes, one module per resource, and what they share.

* :mod:`service.coordinator.routes.access`: Who may do what: the admin token, and tokens
  scoped to queues.
* :mod:`service.coordinator.routes.common`: What every route of the coordinator's API
  shares: the error shape, the token ...
* :mod:`service.coordinator.routes.jobs`: The API's jobs and nodes: ``/v1/jobs``
  (submit, list, get, scale, cancel, eve...
* :mod:`service.coordinator.routes.logs`: The coordinator's log route: a job's worker
  output, read from its nodes' agents.
* :mod:`service.coordinator.routes.queues`: The queues' HTTP API and their storage in
  etcd (``queues/<name>``).
"""
