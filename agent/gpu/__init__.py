"""agent.gpu."""
