"""torch elastic's own metrics, routed into the runner's metrics file.

torch.distributed.elastic reports through ``put_metric`` and the ``@prof``
decorator (``<Class>.<call>.success|failure`` and ``<Class>.<call>.duration.ms``)
to a pluggable :class:`~torch.distributed.elastic.metrics.api.MetricHandler`,
by default one that drops everything. They are emitted in the runner process,
which serves no HTTP; :class:`RecorderMetricHandler` hands them to the
runner's :class:`~agent.runner_metrics.RunnerMetricsRecorder`, which the status
thread writes to ``<job dir>/metrics.json``, and the agent daemon exports them
at scrape time, durations converted to seconds (:mod:`agent.node.metrics`).

This module imports torch: only the runner imports it.
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.metrics.api import MetricData, MetricHandler, configure

from agent.runner_metrics import RunnerMetricsRecorder

log = logging.getLogger(__name__)


class RecorderMetricHandler(MetricHandler):
    """A torch elastic metric handler that feeds a :class:`RunnerMetricsRecorder`.

    ``emit`` runs on torch's code path (every monitor tick): it never raises.
    """

    def __init__(self, recorder: RunnerMetricsRecorder) -> None:
        self._recorder = recorder

    def emit(self, metric_data: MetricData) -> None:
        try:
            self._recorder.observe_elastic(str(metric_data.name), float(metric_data.value))
        except Exception as exc:  # a metric must never break the agent
            log.debug("dropped torch elastic metric %r: %s", metric_data, exc)


def configure_elastic_metrics(recorder: RunnerMetricsRecorder) -> RecorderMetricHandler:
    """Route every torch elastic metric group of this process to ``recorder``."""
    handler = RecorderMetricHandler(recorder)
    configure(handler)
    return handler
