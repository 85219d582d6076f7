"""service.coordinator.main.routes."""
