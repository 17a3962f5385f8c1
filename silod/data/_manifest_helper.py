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


class ManifestUnavailable(Exception):
    """The manifest could not be loaded; the message says why."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def fetch(name: str, address: str, token: str) -> object:
    """The dataset's manifest from the metadata service at ``address``, in this process."""
    import grpc

    from silod.data.catalog import ManifestNotFound, load_manifest
    from silod.rpc.channels import open_channel
    from silod.v1 import metadata_pb2_grpc

    try:
        with open_channel(address, token=token) as channel:
            return load_manifest(metadata_pb2_grpc.MetadataServiceStub(channel), name)
    except ManifestNotFound:
        raise ManifestUnavailable(f"dataset {name!r} is not registered at {address}", 3) from None
    except grpc.RpcError as exc:
        raise ManifestUnavailable(f"cannot load the manifest of {name!r} from {address}: "
                                  f"{exc.code().name}: {exc.details()}", 2) from None


def main(argv: list[str]) -> int:
    name, address = argv

    try:
        manifest = fetch(name, address, os.environ.get("SILOD_AUTH_TOKEN", ""))
    except ManifestUnavailable as exc:
        print(str(exc), file=sys.stderr)
        return exc.exit_code
    sys.stdout.buffer.write(pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
