"""pytest checks/: read only; every step only verifies."""
