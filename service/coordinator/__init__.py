"""The coordinator process (``tidal coordinator``): the FastAPI app, its routes,
settings, store and metrics, and the reconcile loop that applies the scheduler's plan.

* :mod:`service.coordinator.app`: The coordinator's HTTP API (FastAPI): jobs, nodes,
  metrics, health.
* :mod:`service.coordinator.main`: One coordinator process: the API, the reconcile loop
  and the election, wired together.
* :mod:`service.coordinator.metrics`: The coordinator's Prometheus metrics, on an
  injected registry.
* :mod:`service.coordinator.reconciler`: The reconcile loop: only the elected leader
  runs it; etcd watches wake it.
* :mod:`service.coordinator.settings`: Configuration of one coordinator process: flags >
  TIDAL_* environment > defaults.
* :mod:`service.coordinator.store`: The coordinator's reads and writes of etcd: jobs,
  their events, drains, and snapshots.
* :mod:`service.coordinator.views`: How the API shows a job and a node: the job's record
  joined with its nodes' r...
"""
