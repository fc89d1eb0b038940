"""The data plane's wire format, shared by server and client (docs/design/network-path.md).

A ``Batches`` call with ``transport = TRANSPORT_SOCKET`` carries each batch's tensor bytes on a
TCP connection of its own beside the call (plain, or TLS when the gRPC port uses TLS):

* the server answers the call with initial metadata ``batchd-data-port`` (decimal port) and
  ``batchd-data-token`` (``TOKEN_BYTES`` random bytes, hex);
* the client connects to that port on the host it dialed for gRPC and sends the token's
  ``TOKEN_BYTES`` raw bytes, nothing else, ever;
* for each batch, in the order of the call's ``Batch`` messages, the server writes a ``HEADER``
  (24 bytes, little-endian: magic ``b"BDP1"``, 4 reserved bytes (0), batch_index u64, payload
  length u64) and then the payload: the batch's tensors at the ``Tensor.offset`` the message
  names, each at a multiple of ``ALIGN`` bytes, zeros between them; its length is the end of
  the last tensor (``payload_layout``).
"""

from __future__ import annotations

import struct
from typing import Iterable, NamedTuple

from batchd import errors

MAGIC = b"BDP1"
HEADER = struct.Struct("<4sIQQ")  # magic, reserved, batch_index, payload length: 24 bytes
TOKEN_BYTES = 32
PORT_KEY = "batchd-data-port"
TOKEN_KEY = "batchd-data-token"
ALIGN = 64  # bytes: every tensor of a payload starts on a cache line, as in a shared-memory slot


def pack_header(batch_index: int, length: int) -> bytes:
    """The 24-byte header of batch ``batch_index`` whose payload is ``length`` bytes."""
    return HEADER.pack(MAGIC, 0, batch_index, length)


def unpack_header(data: bytes | memoryview) -> tuple[bytes, int, int]:
    """(magic, batch_index, length) of a 24-byte header (the reserved field is not looked at)."""
    magic, _reserved, batch_index, length = HEADER.unpack(data)
    return magic, batch_index, length


class Piece(NamedTuple):
    """One tensor's bytes: ``nbytes`` at ``source`` in the slot go to ``offset`` in the payload."""

    source: int
    nbytes: int
    offset: int


def payload_layout(tensors: Iterable[tuple[int, int]]) -> tuple[list[Piece], int]:
    """Where each tensor goes in a payload, and the payload's length in bytes.

    tensors: (offset in the slot, bytes) per tensor, in the batch's order. Each tensor is put at
    the next multiple of ``ALIGN`` after the one before, so the payload holds the tensors' bytes
    and zero padding only (never the rest of a reused slot, which may hold another batch's bytes).
    Returns one ``Piece`` per tensor, in the same order, and the end of the last (0 for none).
    """
    pieces, end = [], 0
    for source, nbytes in tensors:
        offset = (end + ALIGN - 1) // ALIGN * ALIGN
        pieces.append(Piece(source, nbytes, offset))
        end = offset + nbytes
    return pieces, end


def metadata(port: int, token: bytes) -> tuple[tuple[str, str], tuple[str, str]]:
    """The initial metadata entries that offer a data connection."""
    return (PORT_KEY, str(port)), (TOKEN_KEY, token.hex())


def offered(entries) -> tuple[int, bytes] | None:
    """(port, token) from a call's initial metadata, None when the server offers no data
    connection (it answers inline). Raises ConnectionError if an entry is malformed."""
    found = {}
    for item in entries or ():
        key, value = item[0], item[1]
        if key in (PORT_KEY, TOKEN_KEY):
            found[key] = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    if PORT_KEY not in found and TOKEN_KEY not in found:
        return None
    try:
        port = int(found[PORT_KEY])
        token = bytes.fromhex(found[TOKEN_KEY])
    except (KeyError, ValueError):
        raise errors.ConnectionError(f"the server offered a malformed data connection: {sorted(found)}") from None
    if not 0 < port < 65536 or len(token) != TOKEN_BYTES:
        raise errors.ConnectionError(f"the server offered a malformed data connection (port {port}, "
                                     f"a token of {len(token)} bytes)")
    return port, token
