"""Which servers an ``address`` names: one, a list, a DNS name with several A records, or a file.

``RemoteDataLoader(address, ...)`` reads from several servers when ``server_addresses(address)``
returns more than one, or when ``address`` may name more later (``may_grow``):

* a list or tuple of addresses: each one, expanded as below (duplicates dropped, order kept);
* ``dns:///NAME:PORT`` (gRPC's name syntax) or a plain ``NAME:PORT``: every IPv4 address that
  ``socket.getaddrinfo`` gives for NAME (IPv6 when there is none), sorted, as ``IP:PORT``. A
  Kubernetes headless Service (``clusterIP: None``) answers with one A record per ready pod, so
  ``dns:///batchd.default.svc.cluster.local:50051`` reaches every replica. A name with a single
  address, or one that does not resolve, is kept as given (gRPC resolves it itself);
* ``file:PATH``: a text file with one address per line (``HOST:PORT``, ``unix:PATH``; blank
  lines and lines starting with ``#`` are skipped; names are expanded as above), for tests and
  for operators without DNS;
* ``unix:PATH``, an IP literal ``IP:PORT`` / ``[IPv6]:PORT``: that one server.

Names and files are read when the loader is built and again while it runs (``AddressSource``,
every ``probe_interval``): servers that appear are probed and given work, servers no longer listed
get none. A plain ``NAME:PORT`` with one address is one server (a single-server loader, as gRPC
resolves it); ``dns:///NAME:PORT`` or ``file:PATH`` keep a several-servers loader even while they
list one server, so that others can join. To read through a name from one server only, resolve
it yourself.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Iterable

_DNS_PREFIXES = ("dns:///", "dns:")
FILE_PREFIX = "file:"


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


def _name(address: str) -> tuple[str, str] | None:
    """(host, port) of an address whose host is a DNS name; None for an IP literal, ``unix:`` and
    other forms (one server each, never resolved here)."""
    parts = _split_host_port(address)
    if parts is None:
        return None
    try:
        ipaddress.ip_address(parts[0].strip("[]"))
    except ValueError:
        return parts  # (not an IP literal: a name)
    return None


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


def read_address_file(path: str) -> list[str]:
    """The addresses listed in the file at ``path``: one per line, blank lines and ``#`` comments
    skipped. Raises ValueError naming the file and line of an entry that is not an address, OSError
    if the file cannot be read."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            if (" " in entry or entry.startswith(FILE_PREFIX)
                    or (_split_host_port(entry) is None and not entry.startswith("unix:"))):
                raise ValueError(f"{path}, line {number}: {entry!r} is not HOST:PORT or unix:PATH")
            out.append(entry)
    return out


def expand(address: str, *, keep_single_name: bool = True) -> list[str]:
    """The servers one address string names (see the module docstring). keep_single_name: a name
    with one address stays as given (gRPC resolves it); False: ``IP:PORT`` as for several.
    Raises ValueError for an empty address or a ``file:`` that cannot be read or lists none."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"address must be HOST:PORT, dns:///NAME:PORT, file:PATH or unix:PATH, got {address!r}")
    if address.startswith(FILE_PREFIX):
        path = address[len(FILE_PREFIX):]
        try:
            listed = read_address_file(path)
        except OSError as e:
            raise ValueError(f"cannot read the server list {address}: {e.strerror or e}") from None
        return [a for item in listed for a in expand(item, keep_single_name=keep_single_name)]
    parts = _name(address)
    if parts is None:
        return [address]
    found = resolve(*parts)
    return found if len(found) > 1 or (found and not keep_single_name) else [address]


def server_addresses(address: str | Iterable[str], *, keep_single_name: bool = True) -> list[str]:
    """Every server ``address`` names, in order, without duplicates. Raises ValueError if none."""
    items = _items(address) if address is not None else []
    if not items:
        raise ValueError("address must name at least one server")
    out = list(dict.fromkeys(a for item in items for a in expand(item, keep_single_name=keep_single_name)))
    if not out:
        raise ValueError(f"{address!r} names no server")
    return out


def _items(address: str | Iterable[str]) -> list:
    return [address] if isinstance(address, str) else list(address)


def is_name(address: str | Iterable[str]) -> bool:
    """Whether ``address`` contains a DNS name or a ``file:`` list, whose servers may change
    (worth reading again)."""
    return any(isinstance(item, str) and (item.startswith(FILE_PREFIX) or _name(item) is not None)
               for item in _items(address))


def may_grow(address: str | Iterable[str]) -> bool:
    """Whether ``address`` asks for a several-servers loader even while it names one server: it
    has a ``file:`` list or an explicit ``dns:`` name (servers may join later)."""
    return any(isinstance(item, str) and (item.startswith(FILE_PREFIX) or item.startswith(_DNS_PREFIXES))
               for item in _items(address))


class AddressSource:
    """The servers ``address`` names, read again on demand (``current``): DNS names resolved anew,
    a ``file:`` list re-read when its size or modification time changed."""

    def __init__(self, address: str | Iterable[str]):
        self.address = address
        self.changes = is_name(address)
        self._files: dict[str, tuple[tuple[int, int], list[str]]] = {}  # path -> ((mtime_ns, size), entries)

    def _file(self, path: str) -> list[str]:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size)
        known = self._files.get(path)
        if known is None or known[0] != stamp:
            known = self._files[path] = (stamp, read_address_file(path))
        return known[1]

    def current(self) -> list[str] | None:
        """Every server the address names now, as ``IP:PORT`` for names (the order of
        ``server_addresses``); None when that cannot be told now (a name that does not resolve, a
        file that cannot be read or lists nothing, or an address that never changes): keep the
        servers known."""
        if not self.changes:
            return None
        out: list[str] = []
        try:
            for item in _items(self.address):
                listed = self._file(item[len(FILE_PREFIX):]) if item.startswith(FILE_PREFIX) else [item]
                for entry in listed:
                    found = [entry] if (parts := _name(entry)) is None else resolve(*parts)
                    if not found:
                        return None
                    out.extend(a for a in found if a not in out)
        except (OSError, ValueError):
            return None
        return out or None
