"""The node's GPUs as the daemon sees them: NVML (no CUDA context), health and metrics.

* :mod:`agent.gpu.devices`: Which of the node's GPUs a job gets: a pure decision, and
  what the agent remembers of it.
* :mod:`agent.gpu.metrics`: The GPUs' metrics, read at scrape time from the agent's last
  GPU poll.
* :mod:`agent.gpu.nvml`: The node's GPUs: what there is, whether it is healthy, how busy
  it is.
"""
