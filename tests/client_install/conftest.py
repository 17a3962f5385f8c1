"""The fixtures of tests/client_install/installs.py: the wheel, a cluster for client jobs."""

from tests.client_install.installs import sdk_cluster, silod_wheel

__all__ = ["sdk_cluster", "silod_wheel"]
