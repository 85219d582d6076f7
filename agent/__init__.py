"""The tidal node agent: registers a node in etcd and runs the workers of the
jobs assigned to it through torch.distributed.elastic.

Two processes and the workers' side, one folder each:

* :mod:`agent.node`: the daemon (``tidal agent``), one per machine;
* :mod:`agent.runner`: the job runner (``python -m agent.runner``), one per job on a node;
* :mod:`agent.workers`: what runs around each worker (zygote, shim, lifeline, user, logs);
* :mod:`agent.gpu`: the node's GPUs through NVML (the daemon's view);
* at the root, the daemon <-> runner contracts: the runner's spec (``spec``), its run
  directory (``rundir``), admission, bounds, progress and the runner's metrics file.
"""
