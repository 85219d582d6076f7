"""What runs around each worker process: the zygote that forks it, the shim and
lifeline that tie it to the runner, its user, its log capture and its paths.

* :mod:`agent.workers.jobpaths`: A job's working and checkpoint directories, checked
  where the runner uses them.
* :mod:`agent.workers.lifeline`: Tie a process's life to its parent's: the parent-death
  signal.
* :mod:`agent.workers.logcap`: Keep each rank's log files under a size cap, without
  stopping the workers.
* :mod:`agent.workers.shim`: Start a worker command so that it dies with the process
  that started it.
* :mod:`agent.workers.user`: Run a job's workers as another user than the agent's
  (``--worker-user``).
* :mod:`agent.workers.zygote`: Pre-started workers: a process that has imported torch
  and forks each worker.
"""
