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

Even so, under load a server still dropped silod's own long-lived connections: in a benchmark
on a 2-core machine, both cache servers' plan watches (to the scheduler), their calls to the
metadata store and their peer channels were cut with "too_many_pings" several times within two
minutes. A client does not only send keepalive pings (it also probes its flow-control window
after receiving data, and more), and gRPC's default tolerates two pings it judges too early.
Servers here only serve silod clients, so they count no such strikes at all
(``max_ping_strikes`` 0); a dead client is still found by the server's own keepalive pings.
tests/runtime/test_keepalive_pings.py: a client pinging every 200 ms keeps its watch.

The nodes' plan watches do not wait for this to leave a leader gone silent (15 s, and a new
connection to a frozen host never completes its handshake): they watch every scheduler at once
and a standby answers its held watches the moment it wins the lease (worker_agent/node_protocol.py,
scheduler/live/watch.py).
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
    ("grpc.http2.max_ping_strikes", 0),  # 0 = never answer pings with GOAWAY (see above)
    ("grpc.http2.max_pings_without_data", 0),
]
