"""Who is connected and what each client holds: sessions, instances, leases, saves (registry.py)."""
