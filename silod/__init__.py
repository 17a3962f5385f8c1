"""silod: the client package — CLI, job SDK and the generated silod.v1 gRPC stubs."""

__version__ = "0.1.0"
