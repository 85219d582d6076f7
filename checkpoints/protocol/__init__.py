"""The runner <-> worker contract, standard library only: the variables a worker
is given, the live resize's files and the progress file. The runner, the agent
daemon and the coordinator import it without torch; the library's face
(:mod:`checkpoints`) loads lazily so that importing this does not pull torch.

* :mod:`checkpoints.protocol.env`: The environment a job's runner and workers get from
  tidal: every ``TIDAL_*`` name, once.
* :mod:`checkpoints.protocol.live`: The live resize's files: the contract between a
  node's runner and its workers.
* :mod:`checkpoints.protocol.progress`: A worker's progress report, one file per rank
  under ``TIDAL_PROGRESS_DIR``.
"""
