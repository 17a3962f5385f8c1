"""Message size limits shared by every silod server and client.

gRPC's default 4 MiB receive limit is too small for silod's batch calls: a scheduling round
asks the estimator for tens of thousands of predictions in one Predict, and a plan for a
large cluster is one message. Both ends use the same larger limit so that what one side may
send the other accepts.
"""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
