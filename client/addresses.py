"""Which servers an ``address`` names: one, a list, or a DNS name with several A records.

``RemoteDataLoader(address, ...)`` reads from several servers when ``server_addresses(address)``
returns more than one:

* a list or tuple of addresses: each one, expanded as below (duplicates dropped, order kept);
* ``dns:///NAME:PORT`` (gRPC's name syntax) or a plain ``NAME:PORT``: every IPv4 address that
  ``socket.getaddrinfo`` gives for NAME (IPv6 when there is none), sorted, as ``IP:PORT``. A
  Kubernetes headless Service (``clusterIP: None``) answers with one A record per ready pod, so
  ``dns:///batchd.default.svc.cluster.local:50051`` reaches every replica. A name with a single
  address, or one that does not resolve, is kept as given (gRPC resolves it itself);
* ``unix:PATH``, an IP literal ``IP:PORT`` / ``[IPv6]:PORT``: that one server.

Names are resolved when the loader is built and again while it runs (replicas that appear are
probed and given work). To read through a name from one server only, resolve it yourself.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Iterable

_DNS_PREFIXES = ("dns:///", "dns:")


def _split_host_port(address: str) -> tuple[str, str] | None:
    """(host, port) of a ``HOST:PORT`` / ``dns:///HOST:PORT`` address, or None for other forms."""
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return None
    rest = address
    if rest.startswith("dns://"):
        rest = rest[len("dns://"):]
        rest = rest.split("/", 1)[1] if "/" in rest else rest  # dns://[authority]/name:port
    elif rest.startswith("dns:"):
        rest = rest[len("dns:"):]
    if "://" in rest or rest.startswith("ipv4:") or rest.startswith("ipv6:"):
        return None
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host, port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def resolve(host: str, port: str) -> list[str]:
    """``IP:PORT`` for every address of ``host`` (IPv4; IPv6 if it has none), sorted; [] if none."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = socket.getaddrinfo(host, int(port), family, socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError, OSError):
            continue
        ips = sorted({info[4][0] for info in infos}, key=lambda ip: ipaddress.ip_address(ip))
        if ips:
            return [f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}" for ip in ips]
    return []


def expand(address: str) -> list[str]:
    """The servers one address string names (see the module docstring)."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"address must be HOST:PORT, dns:///NAME:PORT or unix:PATH, got {address!r}")
    parts = _split_host_port(address)
    if parts is None or _is_ip(parts[0]):
        return [address]
    found = resolve(*parts)
    return found if len(found) > 1 else [address]


def server_addresses(address: str | Iterable[str]) -> list[str]:
    """Every server ``address`` names, in order, without duplicates. Raises ValueError if none."""
    items = [address] if isinstance(address, str) else list(address) if address is not None else []
    if not items:
        raise ValueError("address must name at least one server")
    out: list[str] = []
    for item in items:
        for a in expand(item):
            if a not in out:
                out.append(a)
    return out


def is_name(address: str | Iterable[str]) -> bool:
    """Whether ``address`` contains a DNS name whose addresses may change (worth resolving again)."""
    items = [address] if isinstance(address, str) else list(address)
    for item in items:
        parts = _split_host_port(item) if isinstance(item, str) else None
        if parts is not None and not _is_ip(parts[0]):
            return True
    return False


def single_address(address: str | Iterable[str]) -> str:
    """The one address of a single-server loader (a one-element list is unwrapped)."""
    if isinstance(address, str):
        return address
    items = list(address) if address is not None else []
    if len(items) != 1 or not isinstance(items[0], str):
        raise ValueError(f"expected one server address, got {address!r}")
    return items[0]
