"""``python -m silod.data._manifest_helper NAME ADDRESS``: load a manifest in a throw-away process
and write it (pickled) to stdout.

SilodDataset is created in the process that later forks DataLoader workers. gRPC is not
fork-safe once initialized (its threads and locks are copied mid-flight: forked workers can
deadlock), so that process must not open a channel at all: the manifest is fetched here.
The auth token comes from SILOD_AUTH_TOKEN. Exit codes: 0 ok, 3 not registered, 2 other error
(message on stderr).
"""

from __future__ import annotations

import os
import pickle
import sys


def main(argv: list[str]) -> int:
    name, address = argv
    import grpc

    from silod.rpc.channels import open_channel
    from silod.data.catalog import ManifestNotFound, load_manifest
    from silod.v1 import metadata_pb2_grpc

    try:
        with open_channel(address, token=os.environ.get("SILOD_AUTH_TOKEN", "")) as channel:
            manifest = load_manifest(metadata_pb2_grpc.MetadataServiceStub(channel), name)
    except ManifestNotFound:
        print(f"dataset {name!r} is not registered at {address}", file=sys.stderr)
        return 3
    except grpc.RpcError as exc:
        print(f"cannot load the manifest of {name!r} from {address}: {exc.code().name}: {exc.details()}",
              file=sys.stderr)
        return 2
    sys.stdout.buffer.write(pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
