"""service.client.sync."""
