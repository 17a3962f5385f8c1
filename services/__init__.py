"""Server-side runtime shared by every silod process, and the metadata store."""
