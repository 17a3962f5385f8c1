"""Client-side helpers for talking to silod services, shared by the SDK, the CLI and the services.

Channels with silod's defaults (retries of UNAVAILABLE, a default deadline, the bearer token,
TLS), health polling and the message size limits both ends agree on. Only grpcio and the
generated contracts (``silod.v1``) are needed: nothing here imports server code.
"""

from silod.rpc.auth import bearer_metadata
from silod.rpc.channels import open_channel, wait_for_ready
from silod.rpc.limits import MAX_MESSAGE_BYTES, MESSAGE_SIZE_OPTIONS

__all__ = ["open_channel", "wait_for_ready", "bearer_metadata", "MAX_MESSAGE_BYTES", "MESSAGE_SIZE_OPTIONS"]
