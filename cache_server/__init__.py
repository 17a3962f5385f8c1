"""Per-node cache server: memory/disk tiers in front of remote dataset storage."""
