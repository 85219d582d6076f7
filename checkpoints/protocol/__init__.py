"""checkpoints.protocol."""
