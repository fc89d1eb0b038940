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
  the last tensor (``payload_layout``);
* where the server offers it (initial metadata ``batchd-data-control: 1``; plain TCP only, see
  below), the client may write on the same connection, after its token, the call's grants and
  revokes: each a ``CONTROL`` header (8 bytes, little-endian: magic ``b"BDC1"``, length u32)
  and a serialized ``BatchesControl`` carrying ``grant``, ``revoke``, ``progress`` and, where
  offered (below), ``release`` (``open`` and ``done`` stay on the call), applied as if they came
  on the call. A grant written there costs the client one ``send`` in the thread that grants,
  where one on the call wakes gRPC's request thread and its channel thread (Table 18). Not with TLS:
  the server's sends and reads would then share one ``SSLSocket`` from two threads, which
  OpenSSL does not allow.
* where the client asked for it (``StreamBatchesRequest.data_messages``) and the server says so
  (initial metadata ``batchd-data-messages: 1``), each batch's ``Batch`` message travels on the
  data connection too, and nothing on the call until its status: the header's magic is then
  ``b"BDM1"`` and its second field the message's length; the serialized message follows the
  header, then the payload. The call's status still ends the call: the server closes the data
  connection after its last frame, and the client reads the status once it sees that end
  between two frames. This saves a gRPC message per batch on both sides (the server's sending
  thread waits for gRPC to take each one; the client's gRPC threads wake for each):
  ``python -m bench.probes.in_band``. TLS or not.
* a ``TRANSPORT_SHARED_MEMORY`` call may use the data connection the same way, for its
  messages and control frames only (``data_messages``): each frame is a ``MESSAGE_MAGIC``
  header and a ``Batch`` message that names the batch's lease and slot, and no payload (length
  0); the bytes stay in shared memory. Where the server says so (initial metadata
  ``batchd-data-releases: 1``), control frames may also carry ``release`` (the leases the
  client freed): a batch then costs no gRPC message on either side (the control path's CPU
  per batch: Table 22, issue 36). A ``unix:`` server, or one without a data plane, sends the
  messages on the call.
"""

from __future__ import annotations

import struct
from typing import Iterable, NamedTuple

from batchd import errors

MAGIC = b"BDP1"
MESSAGE_MAGIC = b"BDM1"  # the header of a frame with its Batch message in band
HEADER = struct.Struct("<4sIQQ")  # magic, reserved (BDM1: message length), batch_index, payload length: 24 bytes
TOKEN_BYTES = 32
PORT_KEY = "batchd-data-port"
TOKEN_KEY = "batchd-data-token"
CONTROL_KEY = "batchd-data-control"
MESSAGES_KEY = "batchd-data-messages"
RELEASES_KEY = "batchd-data-releases"
OPENS_KEY = "batchd-data-opens"
MAX_MESSAGE = 64 << 20  # bytes: a longer in-band Batch message is a protocol error
CONTROL_MAGIC = b"BDC1"
CONTROL = struct.Struct("<4sI")  # magic, length of the BatchesControl that follows: 8 bytes
MAX_CONTROL = 1 << 20  # bytes: a longer control frame is a protocol error
ALIGN = 64  # bytes: every tensor of a payload starts on a cache line, as in a shared-memory slot


def pack_header(batch_index: int, length: int, message: int | None = None) -> bytes:
    """The 24-byte header of batch ``batch_index`` whose payload is ``length`` bytes; with
    ``message`` (the length of its in-band ``Batch`` message, which follows the header) a
    ``MESSAGE_MAGIC`` one. Raises ValueError for a message past ``MAX_MESSAGE`` bytes."""
    if message is None:
        return HEADER.pack(MAGIC, 0, batch_index, length)
    if message > MAX_MESSAGE:
        raise ValueError(f"a Batch message of {message} bytes (at most {MAX_MESSAGE} go on the data connection)")
    return HEADER.pack(MESSAGE_MAGIC, message, batch_index, length)


def unpack_header(data: bytes | memoryview) -> tuple[bytes, int, int]:
    """(magic, batch_index, length) of a 24-byte header (the reserved field is not looked at)."""
    magic, _reserved, batch_index, length = HEADER.unpack(data)
    return magic, batch_index, length


def unpack_frame(data: bytes | memoryview) -> tuple[bytes, int, int, int]:
    """(magic, message length, batch_index, payload length) of a 24-byte header; the message
    length is the reserved field (0 in a ``MAGIC`` header)."""
    return HEADER.unpack(data)


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


def pack_control(message: bytes) -> bytes:
    """One control frame: the ``CONTROL`` header and ``message`` (a serialized ``BatchesControl``).
    Raises ValueError past ``MAX_CONTROL`` bytes."""
    if len(message) > MAX_CONTROL:
        raise ValueError(f"a control frame of {len(message)} bytes (at most {MAX_CONTROL})")
    return CONTROL.pack(CONTROL_MAGIC, len(message)) + message


def metadata(port: int, token: bytes, *, control: bool = False, messages: bool = False) -> tuple[tuple[str, str], ...]:
    """The initial metadata entries that offer a data connection (``control``: and that the
    server reads control frames on it, releases and later ``open``s included; ``messages``: that
    the Batch messages come on it)."""
    entries = ((PORT_KEY, str(port)), (TOKEN_KEY, token.hex()))
    entries += ((CONTROL_KEY, "1"), (RELEASES_KEY, "1"), (OPENS_KEY, "1")) if control else ()
    return entries + ((MESSAGES_KEY, "1"),) if messages else entries


def _flag(entries, key: str) -> bool:
    for item in entries or ():
        if item[0] == key:
            value = item[1].decode("ascii", "replace") if isinstance(item[1], bytes) else item[1]
            return value == "1"
    return False


def controls(entries) -> bool:
    """Whether a call's initial metadata says the server reads control frames on its data connection."""
    return _flag(entries, CONTROL_KEY)


def releases(entries) -> bool:
    """Whether a call's initial metadata says its control frames may carry ``release``."""
    return _flag(entries, RELEASES_KEY)


def opens(entries) -> bool:
    """Whether a call's initial metadata says its control frames may carry a later ``open`` (the next pass)."""
    return _flag(entries, OPENS_KEY)


def messages(entries) -> bool:
    """Whether a call's initial metadata says its Batch messages come on its data connection (``MESSAGE_MAGIC``)."""
    return _flag(entries, MESSAGES_KEY)


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
