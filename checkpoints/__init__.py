"""tidal's checkpoints library: the only tidal code a training script imports.

Atomic, verifiable, asynchronous checkpoints that resume at any world size, a
graceful stop on SIGTERM (exit code :data:`EXIT_PREEMPTED`), progress reports
for the node agent, an elastic data position, and the live resize (a planned
change of the job's nodes without restarting its workers; :class:`Resize`,
exit code :data:`EXIT_LEFT`). It depends on torch and the standard library
only. See docs/checkpoints.md.

The names below load on first use (PEP 562), so that the processes that speak
the worker protocol without training (the agent daemon, the runner, the
coordinator) import :mod:`checkpoints.protocol` without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Each public name and the module that defines it.
_HOMES: dict[str, str] = {
    "Checkpointer": "checkpoints.checkpointer",
    "Resume": "checkpoints.checkpointer",
    "SaveRecord": "checkpoints.checkpointer",
    "BatchPlan": "checkpoints.data",
    "BatchPlanError": "checkpoints.data",
    "ElasticBatchSampler": "checkpoints.data",
    "scale_lr": "checkpoints.data",
    "CheckpointCorruptError": "checkpoints.errors",
    "CheckpointError": "checkpoints.errors",
    "CheckpointStateError": "checkpoints.errors",
    "CheckpointWriteError": "checkpoints.errors",
    "EXIT_LEFT": "checkpoints.live",
    "LiveResizeError": "checkpoints.live",
    "Resize": "checkpoints.live",
    "PROGRESS_DIR_ENV": "checkpoints.progress",
    "FileProgressReporter": "checkpoints.progress",
    "NullProgressReporter": "checkpoints.progress",
    "ProgressReporter": "checkpoints.progress",
    "create_progress_reporter": "checkpoints.progress",
    "EXIT_PREEMPTED": "checkpoints.signals",
}

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


def __getattr__(name: str) -> Any:
    """Load a public name from its module on first use (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'checkpoints' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
