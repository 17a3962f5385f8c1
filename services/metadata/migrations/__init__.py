"""Alembic migrations of the metadata schema (a package so that wheels ship them)."""
