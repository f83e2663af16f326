"""The built-in YAML recipes (data package; see pyproject.toml)."""
