"""The ``batchd`` command: ``serve`` a loader, check a server's ``health``, show its ``status`` (or
watch it live with ``top``), write WebDataset ``shards``."""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys


def _serve(args: argparse.Namespace) -> int:
    from batchd.server.app import serve
    from batchd.server.config import ConfigError, load_config

    try:
        addresses = args.address or [None]  # --address given n times: listen on all n (replacing the config's)
        config = load_config(args.config, address=addresses[0], also_listen=tuple(addresses[1:]) if args.address else None,
                             workers=args.workers, metrics_port=args.metrics_port)
    except ConfigError as e:
        print(f"batchd: {e}", file=sys.stderr)
        return 2
    if args.python_path:
        config = config.model_copy(update={"python_path": (*map(pathlib.Path, args.python_path), *config.python_path)})
    try:
        return serve(config)
    except Exception as e:
        # the operator's code (kind python, python pipelines: errors with a note naming it) and
        # anything unexpected: with the traceback; batchd's own start-up errors: the message
        notes = getattr(e, "__notes__", None)
        plain = isinstance(e, (OSError, ValueError, RuntimeError)) and not notes
        logging.getLogger("batchd").error("cannot start: %s", "\n".join([f"{type(e).__name__}: {e}", *(notes or ())]),
                                          exc_info=None if plain else e)
        return 1


def _tls(args: argparse.Namespace):
    from batchd.client.transport.channel import tls_settings

    return tls_settings(None, args.tls_ca, args.tls_cert, args.tls_key)


def _token(args: argparse.Namespace) -> str | None:
    """--token-file's first line, else $BATCHD_TOKEN (never a command-line argument: ps would show it)."""
    from batchd.client.transport.channel import resolve_token

    if args.token_file is None:
        return resolve_token(None)
    try:
        with open(args.token_file) as f:
            return resolve_token(f.readline())
    except OSError as e:
        raise ValueError(f"cannot read --token-file {args.token_file}: {e.strerror}") from None


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from batchd.client.transport.channel import make_channel

    try:
        channel = make_channel(args.address, tls=_tls(args))  # health needs no token
    except ValueError as e:
        print(f"batchd health: {e}", file=sys.stderr)
        return 2
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _status(args: argparse.Namespace) -> int:
    import json
    import time

    from batchd._status_table import format_status
    from batchd.client.transport.server_stats import get_stats, stats_dict
    from batchd.errors import BatchdError

    if args.watch is not None and args.watch <= 0:
        print("batchd status: --watch needs a positive number of seconds", file=sys.stderr)
        return 2
    try:
        security = {"tls": _tls(args), "token": _token(args)}
    except ValueError as e:
        print(f"batchd status: {e}", file=sys.stderr)
        return 2
    tty = sys.stdout.isatty()
    try:
        while True:
            try:
                reply = get_stats(args.address, timeout=args.timeout, **security)
            except (ConnectionError, TimeoutError, BatchdError) as e:
                print(f"batchd status: {e}", file=sys.stderr, flush=True)
                if not args.watch:
                    return 1
                reply = None  # keep watching: the server may come back
            if reply is not None and args.json:
                print(json.dumps(stats_dict(reply), indent=None if args.watch else 2), flush=True)
            elif reply is not None:
                if args.watch and tty:
                    sys.stdout.write("\x1b[H\x1b[2J")  # clear the screen, as watch(1) does
                print(format_status(reply, args.address) + ("\n" if args.watch and not tty else ""), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _top(args: argparse.Namespace) -> int:
    from batchd import _top
    from batchd.client.transport.server_stats import get_stats

    if args.interval <= 0:
        print("batchd top: --interval needs a positive number of seconds", file=sys.stderr)
        return 2
    try:
        security = {"tls": _tls(args), "token": _token(args)}
    except ValueError as e:
        print(f"batchd top: {e}", file=sys.stderr)
        return 2
    return _top.run(args.address, lambda: get_stats(args.address, timeout=args.timeout, **security),
                    once=args.once, interval=args.interval)


def _shards(args: argparse.Namespace) -> int:
    """Write WebDataset tar shards from an image folder or a manifest (local paths or URLs)."""
    import re
    import tempfile

    from batchd.server.config import ImageFolderConfig, ManifestConfig
    from batchd.server.data.datasets import open_dataset
    from batchd.server.data.datasets.shardwriter import write_shards

    source = args.source
    is_table = source.lower().endswith((".csv", ".parquet", ".pq"))
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}  # credentials: the environment's
    cfg = (ManifestConfig(kind="manifest", path=source, storage_options=options) if is_table
           else ImageFolderConfig(kind="imagefolder", root=source, storage_options=options))
    try:
        with tempfile.TemporaryDirectory(prefix="batchd-shards-") as cache:
            dataset = open_dataset("source", cfg, cache, build=True)
            paths = write_shards(dataset, args.pattern, samples_per_shard=args.samples_per_shard,
                                 progress=lambda done, total: print(f"{done}/{total} samples", file=sys.stderr))
    except (OSError, ValueError) as e:
        print(f"batchd shards: {e}", file=sys.stderr)
        return 1
    field = re.search(r"%0?\d*d", args.pattern)
    if field is None:
        print(f"wrote {len(paths)} shard(s), {len(dataset)} samples: {paths[0]} .. {paths[-1]}")
        return 0
    brace = args.pattern[:field.start()] + "{" + field.group(0) % 0 + ".." + field.group(0) % (len(paths) - 1) + "}" \
        + args.pattern[field.end():]
    print(f"wrote {len(paths)} shard(s), {len(dataset)} samples; config: {{kind: webdataset, shards: \"{brace}\"}}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchd", description="batchd: a data-loading service for training.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a loader server")
    serve.add_argument("--config", required=True, help="YAML config file")
    serve.add_argument("--address", action="append",
                       help="HOST:PORT or unix:PATH (overrides the config); give it again to listen on several, "
                            "e.g. a unix socket and a TCP port for health probes")
    serve.add_argument("--workers", type=int, help="worker processes (overrides the config)")
    serve.add_argument("--python-path", action="append", metavar="DIR",
                       help="a folder the server and its workers import kind python factories and python pipelines "
                            "from (first on sys.path, before the config's python_path); give it again for more")
    serve.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve Prometheus metrics on http://HOST:PORT/metrics, HOST as in the address "
                            "(overrides the config's metrics_port)")
    serve.set_defaults(func=_serve)

    health = sub.add_parser("health", help="exit 0 if the server at ADDRESS reports SERVING (gRPC health)")
    health.add_argument("address", help="HOST:PORT or unix:PATH")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    health.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    _add_tls_arguments(health, token=False)
    health.set_defaults(func=_health)

    status = sub.add_parser("status", help="show a server's open streams, workers and totals (the Stats RPC)")
    status.add_argument("address", help="HOST:PORT or unix:PATH")
    status.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    status.add_argument("--json", action="store_true", help="print the StatsResponse as JSON (one line per refresh with --watch)")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    _add_tls_arguments(status, token=True)
    status.set_defaults(func=_status)

    top = sub.add_parser("top", help="watch a server live: streams (wait, verdict), workers (busy, stage), cache")
    top.add_argument("address", help="HOST:PORT or unix:PATH")
    top.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    top.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1 s)")
    top.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    _add_tls_arguments(top, token=True)
    top.set_defaults(func=_top)

    shards = sub.add_parser("shards", help="write WebDataset tar shards from an image folder or a manifest")
    shards.add_argument("source", help="an image folder (one subfolder per class) or a .csv/.parquet manifest; paths or URLs")
    shards.add_argument("pattern", help="shard file names with a %%d field, e.g. out/train-%%06d.tar")
    shards.add_argument("--samples-per-shard", type=int, default=1000, help="samples per tar file (default 1000)")
    shards.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// sources (credentials from AWS_* variables)")
    shards.set_defaults(func=_shards)
    return parser


def _add_tls_arguments(parser: argparse.ArgumentParser, *, token: bool) -> None:
    parser.add_argument("--tls-ca", metavar="PEM", help="TLS: the CA certificate that signed the server's certificate")
    parser.add_argument("--tls-cert", metavar="PEM", help="TLS: a client certificate (servers that require one)")
    parser.add_argument("--tls-key", metavar="PEM", help="TLS: the client certificate's private key")
    if token:
        parser.add_argument("--token-file", metavar="FILE",
                            help="file holding the bearer token (default: the BATCHD_TOKEN environment variable)")


def configure_logging(level: str) -> None:
    """Log to stderr at ``level`` ("DEBUG", "INFO", "WARNING" or "ERROR"), except that fsspec's
    HTTP filesystem never logs below INFO: at DEBUG it logs every URL it fetches, query string
    included, so a presigned URL's signature or token would reach the log."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("fsspec.http").setLevel(max(logging.INFO, logging.getLevelName(level)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
