"""agent.workers."""
