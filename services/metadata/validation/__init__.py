"""Request validation: pure functions over protobuf messages that raise InvalidArgument
naming the offending field (e.g. "spec.min_gpus", "objects[3].key"). No database access."""
