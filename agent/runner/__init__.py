"""The job runner (``python -m agent.runner SPEC.json``): one process per job on a node,
driving torch's elastic agent on tidal's rendezvous.

* :mod:`agent.runner.__main__`: The job runner's entry point: ``python -m agent.runner
  SPEC.json | --warm``.
* :mod:`agent.runner.elastic`: torch's ``LocalElasticAgent`` with tidal's changes: run
  one job's worker group on this node.
* :mod:`agent.runner.elastic_metrics`: torch elastic's own metrics, routed into the
  runner's metrics file.
* :mod:`agent.runner.live_decide`: The runner's decisions on the live path: can the
  group take it, is a resize or a leave done.
* :mod:`agent.runner.live_path`: The runner's live path: resizing the worker group in
  place, and leaving it live.
* :mod:`agent.runner.netif`: Which network interface carries an address: so that gloo
  and NCCL use the agent's.
* :mod:`agent.runner.restarts`: The runner's restart decisions: what a failure or a
  membership change costs, and what comes next.
* :mod:`agent.runner.setup`: What a job's runner is built from: its rendezvous handler,
  its worker spec, its first status.
* :mod:`agent.runner.status`: Report what this node does for a job: the status record in
  etcd and the metrics file.
"""
