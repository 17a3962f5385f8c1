"""Scheduler: JobService (job front door) and AllocationService (versioned plans)."""
