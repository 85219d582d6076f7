"""tidal's checkpoints library: the only tidal code a training script imports.

Atomic, verifiable, asynchronous checkpoints that resume at any world size, a
graceful stop on SIGTERM (exit code :data:`EXIT_PREEMPTED`), progress reports
for the node agent, an elastic data position, and the live resize (a planned
change of the job's nodes without restarting its workers; :class:`Resize`,
exit code :data:`EXIT_LEFT`). It depends on torch and the standard library
only. See docs/checkpoints.md.
"""

from checkpoints.checkpointer import Checkpointer, Resume, SaveRecord
from checkpoints.data import BatchPlan, BatchPlanError, ElasticBatchSampler, scale_lr
from checkpoints.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStateError,
    CheckpointWriteError,
)
from checkpoints.live import EXIT_LEFT, LiveResizeError, Resize
from checkpoints.progress import (
    PROGRESS_DIR_ENV,
    FileProgressReporter,
    NullProgressReporter,
    ProgressReporter,
    create_progress_reporter,
)
from checkpoints.signals import EXIT_PREEMPTED

__all__ = [
    "EXIT_LEFT",
    "EXIT_PREEMPTED",
    "PROGRESS_DIR_ENV",
    "BatchPlan",
    "BatchPlanError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointStateError",
    "CheckpointWriteError",
    "Checkpointer",
    "ElasticBatchSampler",
    "FileProgressReporter",
    "LiveResizeError",
    "NullProgressReporter",
    "ProgressReporter",
    "Resize",
    "Resume",
    "SaveRecord",
    "create_progress_reporter",
    "scale_lr",
]
