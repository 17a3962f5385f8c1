"""HTTP/2 keepalive shared by every silod client channel and server.

Why: a connection that carried a call while the network between two hosts was down holds
unacknowledged bytes, and TCP retransmits them on an exponential timer. After a 30 s cut the
next retransmission can come 20-30 s after the link is back, and every call on that connection
waits for it (measured in the lab before these options: the cluster converged 26-29 s after a
control-plane partition ended). With pings, a connection whose peer stopped answering is closed
within ``KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS`` and the channel reconnects on its own
backoff (at most 5 s, ``channels._RECONNECT_OPTIONS``) on a fresh connection.

Both ends must agree: a gRPC server by default answers a client that pings an idle connection
more often than every 5 minutes with GOAWAY ("too_many_pings") and drops the connection, so
every silod server accepts pings as often as the clients send them.
"""

KEEPALIVE_TIME_MS = 10_000  # ping a connection idle for this long
KEEPALIVE_TIMEOUT_MS = 5_000  # and close it if the ping is not answered within this

CLIENT_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # Also between calls: a call that timed out during a cut leaves its bytes unacknowledged.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # default 2: pings would stop on an idle connection
]

SERVER_KEEPALIVE_OPTIONS = [
    # The server pings its clients too: a watch stream to an agent cut off is closed, not kept.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_pings_without_data", 0),
]
