"""Per-node worker agent: launches, resizes and stops job processes."""
