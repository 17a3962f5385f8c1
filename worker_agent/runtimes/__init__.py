"""How the worker agent runs a rank: the runtime seam (base) and the runtimes behind it."""
