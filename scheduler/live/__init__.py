"""The live scheduler's mechanism around the pure policies: rounds, plans, job and allocation RPCs."""
