"""A multi-host silod cluster on one machine: one network namespace per host (``silod lab``).

:mod:`silod.lab.netns` makes the namespaces, the bridge and the links; :mod:`silod.lab.compose`
reads the services' commands, environment and health checks from ``deploy/compose.yaml``;
:mod:`silod.lab.cluster` starts them, one namespace per compose service;
:mod:`silod.lab.workload` runs silod/demo.py's mixed workload on a running lab.
"""
