"""Estimator service: the SiloD cache/IO model and Pollux goodput model behind EstimatorService."""
