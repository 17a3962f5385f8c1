"""``silod allocation``: AllocationService's node calls (Watch, Ack, ReportTasks) served apart from
the scheduling rounds, fed each committed plan once by the leading scheduler (PlanFeedService)."""
