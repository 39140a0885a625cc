"""A model zoo of typed Equinox modules with a `checkpoint` field."""
