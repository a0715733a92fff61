"""The connector's native pieces, built on first use and optional (the numpy path is always there)."""
