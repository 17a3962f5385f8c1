"""Built-in jobs the worker agent can run."""
