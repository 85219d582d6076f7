"""The environment a job's runner and workers get from tidal: every ``TIDAL_*`` name, once.

The agent daemon sets some for the runner it starts, the runner for the workers
(besides torch's own ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), and the
checkpoints library and the example scripts read them. The names live here, in a
module that imports nothing, so that the daemon and the coordinator (no torch)
and the checkpoints library (torch, no etcd) can all import it.

A job's own ``env`` may not set any name starting with :data:`RESERVED_PREFIX`
(service.api.models refuses it at submit): these are tidal's.
"""

from __future__ import annotations

from collections.abc import Sequence

RESERVED_PREFIX = "TIDAL_"

# Set by the daemon for the runner (and inherited by the workers).
JOB_ID = "TIDAL_JOB_ID"
NODE_ID = "TIDAL_NODE_ID"
#: The unprivileged user the workers run as (agent.workers.user).
WORKER_USER = "TIDAL_WORKER_USER"

# Set by the runner for the workers; read by the checkpoints library.
#: Where each rank reports progress, just-in-time saves and the live resize
#: (checkpoints.progress, checkpoints.jit, checkpoints.live).
PROGRESS_DIR = "TIDAL_PROGRESS_DIR"
#: The job's ``checkpoint_dir``, resolved under the agent's checkpoint root.
CHECKPOINT_DIR = "TIDAL_CHECKPOINT_DIR"
#: The job's resize policy: the learning-rate rule and the global batch size
#: (service.api.models.ResizePolicy; checkpoints.data applies them).
RESIZE_POLICY = "TIDAL_RESIZE_POLICY"
GLOBAL_BATCH_SIZE = "TIDAL_GLOBAL_BATCH_SIZE"
#: ``0`` turns the just-in-time save off (checkpoints.jit).
JIT_SAVE = "TIDAL_JIT_SAVE"

# The zygote (agent.workers.zygote): pre-started workers.
#: ``0`` in the job's environment: start every worker with ``python`` instead.
ZYGOTE = "TIDAL_ZYGOTE"
#: Modules the zygote imports before forking (default: torch).
ZYGOTE_PRELOAD = "TIDAL_ZYGOTE_PRELOAD"
#: The zygote's unix socket, for the worker shim.
ZYGOTE_SOCKET = "TIDAL_ZYGOTE_SOCKET"

# Set by the runner for the workers of a job on a GPU node.
#: The variable that names a job's devices to CUDA (and to the workers).
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: CUDA numbers devices fastest first unless told to follow the PCI bus, as NVML does.
DEVICE_ORDER = "CUDA_DEVICE_ORDER"


def device_env(devices: Sequence[int] | None) -> dict[str, str]:
    """The environment that gives a job's workers ``devices`` and no others.

    ``None``: the node has no GPUs; nothing is set. An empty list (a job that
    asked for no GPUs on a GPU node) hides every device.
    """
    if devices is None:
        return {}
    return {VISIBLE_DEVICES: ",".join(str(i) for i in devices), DEVICE_ORDER: "PCI_BUS_ID"}
