"""Who may serve: the one process (no etcd) or the replica that holds the etcd leadership key."""
