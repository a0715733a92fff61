"""Native code the server builds on first use (compiled with the system's C compiler, cached)."""
