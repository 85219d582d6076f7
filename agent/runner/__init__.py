"""agent.runner.elastic."""
