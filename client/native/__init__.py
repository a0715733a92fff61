"""The client's native pieces, built on first use and optional (the Python path is always there)."""
