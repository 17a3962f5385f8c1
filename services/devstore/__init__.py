"""Development stores: ``silod store-emulator``, an S3-protocol server over a local directory with
one shared bandwidth limit and a per-request latency (a remote store with a storage budget, for
researchers, the demo and the data-loading benchmark). See :mod:`services.devstore.emulator`."""
