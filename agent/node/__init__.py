"""The agent daemon (``tidal agent``): one per machine. It registers the node,
watches its assignments and starts, stops and reports the job runners.

* :mod:`agent.node.daemon`: The node agent daemon: register the node, follow its
  assignments, run them.
* :mod:`agent.node.gpus`: The agent's GPUs: inventory, offer, device choice and health,
  for the daemon.
* :mod:`agent.node.launch`: Starting a job's runner process: a cold one, or the warm one
  started ahead of the job.
* :mod:`agent.node.logserve`: Serve this node's job logs to the coordinator over HTTP,
  behind a bearer token.
* :mod:`agent.node.metrics`: The agent's Prometheus metrics, on an injected registry.
* :mod:`agent.node.offer`: What the node offers the coordinator, and the jobs that lose
  it: a GPU that fails, GPUs that are not free.
* :mod:`agent.node.plan`: What the agent daemon does with its runners next: pure
  decisions, apart from the acts.
* :mod:`agent.node.settings`: Configuration of one `tidal agent` process: flags >
  TIDAL_* environment > defaults.
* :mod:`agent.node.supervise`: What the agent does when a job's runner has exited: a
  pure decision.
* :mod:`agent.node.warm_policy`: When the agent daemon keeps a warm runner, and when the
  next one starts: pure decisions.
"""
