"""Application profiles: packaged Pollux artifact traces and dataset facts (see SOURCE.md).

Data files live next to this module (``<app>/placements.csv``, ``<app>/scalability.csv``,
``<app>/validation-<bsz>.csv``, ``datasets.csv``) and are read through importlib.resources.
"""

from estimator.profiles.application import (
    MAX_EPOCHS,
    ApplicationProfile,
    Measurement,
    load_profile,
    normalize_placement,
)
from estimator.profiles.loading import DatasetFacts, application_names, dataset_for, read_datasets

# The six applications of the Pollux artifact (the evaluation workloads' and the benchmarks'
# mix); application_names() also lists profiles measured by this project (digits).
POLLUX_APPLICATIONS = tuple(sorted(MAX_EPOCHS))

__all__ = [
    "MAX_EPOCHS",
    "POLLUX_APPLICATIONS",
    "ApplicationProfile",
    "DatasetFacts",
    "Measurement",
    "application_names",
    "dataset_for",
    "load_profile",
    "normalize_placement",
    "read_datasets",
]
