"""service.up.cluster."""
