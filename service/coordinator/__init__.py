"""service.coordinator.main."""
