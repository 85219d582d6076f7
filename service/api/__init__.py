"""service.api."""
