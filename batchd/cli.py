"""The ``batchd`` command: ``serve`` a loader, check a server's ``health``."""

from __future__ import annotations

import argparse
import logging
import sys


def _serve(args: argparse.Namespace) -> int:
    from batchd.server.app import serve
    from batchd.server.config import ConfigError, load_config

    try:
        config = load_config(args.config, address=args.address, workers=args.workers)
    except ConfigError as e:
        print(f"batchd: {e}", file=sys.stderr)
        return 2
    try:
        return serve(config)
    except (OSError, ValueError, RuntimeError) as e:
        logging.getLogger("batchd").error("cannot start: %s", e)
        return 1


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchd", description="batchd: a data-loading service for training.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a loader server")
    serve.add_argument("--config", required=True, help="YAML config file")
    serve.add_argument("--address", help="HOST:PORT or unix:PATH (overrides the config)")
    serve.add_argument("--workers", type=int, help="worker processes (overrides the config)")
    serve.set_defaults(func=_serve)

    health = sub.add_parser("health", help="exit 0 if the server at ADDRESS reports SERVING (gRPC health)")
    health.add_argument("address", help="HOST:PORT or unix:PATH")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    health.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    health.set_defaults(func=_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
