"""agent.node."""
