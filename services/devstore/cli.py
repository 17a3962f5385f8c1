"""``silod store-emulator``: serve a local directory over the S3 protocol with one shared bandwidth
limit and a per-request latency (see :mod:`services.devstore.emulator`).

Kept free of aiohttp and prometheus imports so that ``silod --help`` stays fast: the server code
is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be a number, got {port!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535 (0 = any free port), got {number}")
    return host.strip("[]"), number


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "store-emulator",
        help="serve a directory over the S3 protocol with a shared bandwidth limit and a latency per request",
        description="Serve the files under --root over the S3 protocol (the subset s3fs uses: list, head, get "
        "with Range and If-Match). Each top-level directory of --root is a bucket: ROOT/bench/train/a.jpg is "
        "s3://bench/train/a.jpg. All connections share one --bandwidth-mb-s link; every request waits "
        "--latency-ms first. GET /healthz answers 200 while serving, GET /metrics is Prometheus "
        "(silod_store_emulator_sent_bytes_total: rate() = bytes/s served). Requests are not authenticated: "
        "register datasets with --option endpoint_url=http://HOST:PORT and either --option anon=true or any "
        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment. SIGTERM stops it gracefully (requests in "
        "flight get 5 s to finish).",
    )
    p.add_argument("--root", required=True, help="directory whose subdirectories are the buckets")
    p.add_argument("--listen", type=_listen, default=("127.0.0.1", 9000), metavar="HOST:PORT",
                   help="address to serve on; port 0 = any free port (default 127.0.0.1:9000)")
    p.add_argument("--bandwidth-mb-s", type=_non_negative, default=0.0, metavar="MB_PER_S",
                   help="one bandwidth limit shared by all connections, in MB/s (10^6 bytes); 0 = unlimited (default)")
    p.add_argument("--latency-ms", type=_non_negative, default=0.0, metavar="MS",
                   help="latency added to every S3 request, in milliseconds (default 0)")
    p.add_argument("--ready-file", default="", metavar="FILE",
                   help="write HOST:PORT here once serving (removed on shutdown)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-format", default="text", choices=("text", "json"))
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import types

    from services.runtime.structured_logging import configure_logging
    from services.devstore.emulator import EmulatorConfig, EmulatorConfigError, serve

    # Checked when run, not when parsed, so that documented command lines parse anywhere.
    if not os.path.isdir(args.root):
        print(f"silod store-emulator: --root: {args.root!r} is not a directory", file=sys.stderr)
        return 2
    host, port = args.listen
    config = EmulatorConfig(root=args.root, host=host, port=port, bandwidth_bytes_per_s=args.bandwidth_mb_s * 1e6,
                            latency_s=args.latency_ms / 1000, ready_file=args.ready_file)
    try:
        config.check()
    except EmulatorConfigError as exc:
        print(f"silod store-emulator: configuration error: {exc}", file=sys.stderr)
        return 2
    configure_logging(types.SimpleNamespace(log_format=args.log_format, log_level=args.log_level),  # type: ignore[arg-type]
                      process="store-emulator")
    try:
        asyncio.run(serve(config))
    except OSError as exc:  # the port is taken, the ready file cannot be written ...
        print(f"silod store-emulator: cannot start: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        from services.runtime.server import StartupError

        if isinstance(exc, StartupError):
            print(f"silod store-emulator: cannot start: {exc}", file=sys.stderr)
            return 1
        raise
    return 0
