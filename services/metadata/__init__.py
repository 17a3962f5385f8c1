"""The metadata store: the only process that touches the database (SQLite or PostgreSQL)."""
