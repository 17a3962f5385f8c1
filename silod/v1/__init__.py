"""Generated protobuf messages and gRPC stubs of the silod.v1 contracts (see protos/).

Do not edit the *_pb2* files: run `make proto`. The test suite fails when they are stale.
"""
