"""Example training scripts and demos for tidal."""
