"""The receive relay's process: it holds the trainer's data connections and writes each batch's
payload into a buffer the trainer has mapped (client/transport/relay.py starts it; docs/network.md).

Run as ``python -I relay_child.py SPEC`` by ``batchd.client.transport.relay.Relay``, never imported by
batchd: it uses the standard library only, so it starts in a few tens of milliseconds and holds
none of the trainer's state (no gRPC, no torch, no CUDA context). SPEC (JSON) gives the data
plane's header (``struct`` format, magic: ``batchd.datawire``, so the format has one source)
the read slice in seconds and the control socket's fd.

Protocol (AF_UNIX SOCK_SEQPACKET: one message per send; fds by SCM_RIGHTS):

* Each message on the control socket is ``OPEN`` (JSON: address (named in errors), host, port,
  token (hex), tls (ca, cert, key, server_name; or null), connect_timeout, timeout) with one
  fd: the relay's end of a fresh socketpair for that data connection. A thread of its own then
  dials the server, speaks TLS if asked, sends the token and answers on the pair ``O`` (opened)
  or ``X`` + the error's text. EOF on the control socket ends the process: the trainer closed the relay, or
  died (the kernel closes a dead process's sockets, SIGKILL included; a child it forked without
  exec, such as a DataLoader worker, holds the socket open until it exits too). Not
  PR_SET_PDEATHSIG: that fires when the *thread* that started the relay ends.
* On a connection's pair the trainer sends ``READ`` (``REQUEST``: op ``R``, buffer id, batch
  index, payload length, buffer size) with the buffer's memfd the first time it names that
  buffer on this connection. The relay reads the 24-byte header, checks magic, index and length,
  reads the payload straight into the buffer (``recv_into``: one kernel copy, in this process)
  and answers ``D`` + the bytes read (``DONE``), or ``E`` + the error's text (``X`` + the text
  where the server had sent no byte yet: it refused the connection), after which the
  connection is closed. Where the call's Batch messages come on the data connection (in-band
  frames, ``BDM1``), the trainer sends ``N`` instead (``REQUEST`` with a buffer, the other
  fields 0): the relay waits for the next frame's header with no time limit (the trainer watches
  the call), reads its message, then its payload into the buffer with the message right after
  it, and answers ``M`` (``FRAME``: message length, batch index, payload length); a buffer
  smaller than both gets ``S`` (the same fields, nothing written) followed by the message in
  ``m`` + up to ``MESSAGE_CHUNK`` bytes answers, so that the trainer checks the message (its
  length against the loader's maximum, its tensors against the header's payload length) before
  it takes a buffer of that length, and sends ``P`` with one; the server closing the
  connection between frames gets ``F``, after which the connection is closed. The trainer may also send ``C`` + a control frame (the call's grants
  and revokes), which the relay writes on the data connection as it is (no answer). EOF on
  the pair (the trainer closed the connection) ends the thread and closes the data
  connection, also while a read waits (it looks every SLICE seconds; a control frame waiting
  there is written then).

A buffer stays mapped here while its connection lives (one mapping per buffer and connection,
made once: a buffer is reused batch after batch, so its pages are faulted in once).
"""

from __future__ import annotations

import json
import mmap
import os
import select
import socket
import ssl
import struct
import sys
import threading
import time

REQUEST = struct.Struct("<cxxxIQQQ")  # op, buffer id, batch index, payload length, buffer size: 32 bytes
DONE = struct.Struct("<cxxxxxxxQ")  # op, bytes read
FRAME = struct.Struct("<cxxxIQQ")  # op (M, S), message length, batch index, payload length: 24 bytes
MAX_MESSAGE = 4096  # bytes: a READ, or C + a control frame (a longer frame goes on the call instead)
MESSAGE_CHUNK = 32768  # bytes of a frame's Batch message per ``m`` answer (after ``S``)


class Failed(Exception):
    """A connection's error, sent to the trainer as ``E`` + its text."""


class Connection:
    """One data connection and its pair to the trainer (one thread)."""

    def __init__(self, pair: socket.socket, spec: dict, relay: dict):  # (``OPEN``'s spec, the process's)
        self.pair, self.spec, self.slice_s = pair, spec, relay["slice_s"]
        self.header, self.magic = struct.Struct(relay["header"]), relay["magic"].encode("latin-1")
        # an in-band frame's header (N), and its message's longest (the loader's)
        self.frame_magic = relay["message_magic"].encode("latin-1")
        self.max_message = min(relay["max_message"], spec.get("max_message", relay["max_message"]))
        self.where = f"the data port {spec['port']} of the batchd server at {spec['address']}"
        self.sock: socket.socket | None = None
        self.received = 0  # bytes read from the data connection (none: an error is a refusal, ``X``)
        self.maps: dict[int, mmap.mmap] = {}
        self.head = bytearray(self.header.size)
        self.pending: tuple[int, int, int, bytearray] | None = None  # a frame read up to its payload (N, S)

    def run(self) -> None:
        try:
            try:
                self.sock = self._connect()
            except Failed as e:
                self._fail(e)
                return
            self.pair.send(b"O")
            while True:
                msg, fds, _, _ = self.pair.recvmsg(MAX_MESSAGE, socket.CMSG_LEN(4))
                got = _fds(fds)
                if not msg:
                    return  # the trainer closed the connection
                if msg[:1] == b"C":
                    try:
                        self._control(msg)
                    except Failed as e:  # (the trainer reads it as its next read's answer)
                        self._fail(e)
                        return
                    continue
                op, buf_id, index, length, size = REQUEST.unpack(msg)
                try:
                    if got and buf_id not in self.maps:
                        try:
                            self.maps[buf_id] = mmap.mmap(got[0], size)
                        except (OSError, ValueError, OverflowError) as e:
                            raise Failed(f"cannot map the trainer's buffer {buf_id} of {size} bytes: {e}") from None
                    if buf_id not in self.maps:
                        raise Failed(f"a READ into buffer {buf_id}, whose descriptor never came")
                    if op in (b"N", b"P"):  # an in-band frame (answered in _frame)
                        if not self._frame(op, buf_id, size):
                            return
                        continue
                    if length > len(self.maps[buf_id]):
                        raise Failed(f"a READ of {length} bytes into a buffer of {len(self.maps[buf_id])}")
                    self._read(memoryview(self.head))
                    magic, _, sent_index, sent = self.header.unpack(self.head)
                    if magic != self.magic or sent_index != index or sent != length:
                        raise Failed(f"{self.where} sent a header for batch {sent_index} of {sent} bytes (magic "
                                     f"{bytes(magic)!r}) where batch {index} of {length} bytes was due")
                    with memoryview(self.maps[buf_id]) as whole:  # (released: the mapping can close)
                        self._read(whole[:length])
                except Failed as e:
                    self._fail(e)
                    return
                finally:
                    for fd in got:
                        os.close(fd)
                self.pair.send(DONE.pack(b"D", length))
        except OSError:
            return  # the pair broke: the trainer is gone
        finally:
            if self.sock is not None:
                self.sock.close()
            self.pair.close()
            for mm in self.maps.values():
                try:
                    mm.close()
                except BufferError:  # a view still held by an exception's frame: unmapped when collected
                    pass

    def _frame(self, op: bytes, buf_id: int, size: int) -> bool:
        """Answer ``N`` or ``P`` into buffer ``buf_id`` (module docstring). False once the server
        closed the connection between frames (answered ``F``). Failed for a header that is not a
        frame's."""
        if op == b"N":
            if self.pending is not None:
                raise Failed("a READ of the next frame before the last one's payload")
            if not self._read(memoryview(self.head), idle=True):
                self.pair.send(b"F")
                return False
            magic, mlen, index, length = self.header.unpack(self.head)
            if magic != self.frame_magic or mlen > self.max_message:
                raise Failed(f"{self.where} sent a header with magic {bytes(magic)!r} and a message of {mlen} bytes "
                             f"where a frame was due")
            message = bytearray(mlen)
            self._read(memoryview(message))
            self.pending = (mlen, index, length, message)
        elif self.pending is None:
            raise Failed("a READ of a frame's payload with no frame begun")
        mlen, index, length, message = self.pending
        if length + mlen > size:
            if op == b"P":
                raise Failed(f"a buffer of {size} bytes for a frame of {length + mlen}")
            # the message first: the trainer checks it (and the payload length against its tensors)
            # before it takes a buffer of the header's length
            self.pair.send(FRAME.pack(b"S", mlen, index, length))
            for at in range(0, mlen, MESSAGE_CHUNK):
                self.pair.send(b"m" + bytes(message[at:at + MESSAGE_CHUNK]))
            return True
        with memoryview(self.maps[buf_id]) as whole:  # (released: the mapping can close)
            self._read(whole[:length])
            whole[length:length + mlen] = message
        self.pending = None
        self.pair.send(FRAME.pack(b"M", mlen, index, length))
        return True

    def _connect(self) -> socket.socket:
        spec = self.spec
        try:
            raw = socket.create_connection((spec["host"], spec["port"]), timeout=spec["connect_timeout"])
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a control frame leaves at once (no Nagle)
        except OSError as e:
            raise Failed(f"cannot connect to {self.where}: {e.strerror or e}") from None
        sock = raw
        try:
            tls = spec.get("tls")
            if tls is not None:
                ctx = ssl.create_default_context(cafile=tls.get("ca"))
                if tls.get("cert"):
                    ctx.load_cert_chain(tls["cert"], tls.get("key"))
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                sock = ctx.wrap_socket(raw, server_hostname=tls.get("server_name") or spec["host"])
            sock.sendall(bytes.fromhex(spec["token"]))
        except (OSError, ssl.SSLError) as e:
            sock.close()
            raw.close()
            raise Failed(f"cannot open a data connection to {self.where}: {e}") from None
        sock.settimeout(self.slice_s)
        return sock

    def _read(self, view: memoryview, idle: bool = False) -> bool:
        """Fill ``view`` from the data connection (True); Failed on a silent (``timeout``), closed
        or broken one; raises OSError when the trainer closes the pair. ``idle`` (a frame's header,
        between batches): no time limit before the first byte, and False if the connection
        closes before it."""
        got, total, last = 0, len(view), time.monotonic()
        while got < total:
            try:
                n = self.sock.recv_into(view[got:])
            except (TimeoutError, BlockingIOError, ssl.SSLWantReadError):
                while select.select([self.pair], [], [], 0)[0]:  # the trainer sent a control frame, or closed
                    msg = self.pair.recv(MAX_MESSAGE)
                    if msg[:1] != b"C":
                        raise OSError("the trainer closed the connection") from None
                    self._control(msg)
                if idle and not got:
                    last = time.monotonic()
                elif time.monotonic() - last > self.spec["timeout"]:
                    raise Failed(f"{self.where} brought no byte for {self.spec['timeout']:g} s") from None
                continue
            except (OSError, ssl.SSLError) as e:
                raise Failed(f"the data connection to {self.where} broke: "
                             f"{e.strerror if isinstance(e, OSError) and e.strerror else e}") from None
            if not n:
                if idle and not got:
                    return False
                raise Failed(f"{self.where} closed its data connection ({got} of {total} bytes read)")
            got += n
            self.received += n
            last = time.monotonic()
        return True

    def _control(self, msg: bytes) -> None:
        """Write a control frame (``C`` + the frame) on the data connection; Failed if it broke."""
        try:
            self.sock.sendall(msg[1:])
        except (OSError, ssl.SSLError) as e:
            raise Failed(f"the data connection to {self.where} broke (sending a grant): {e}") from None

    def _fail(self, e: Failed) -> None:
        """Answer a connection's error: ``X`` before the server sent any byte (it refused the
        connection: the trainer may dial again), ``E`` after."""
        self.pair.send((b"E" if self.received else b"X") + str(e).encode())


def _fds(ancillary) -> list[int]:
    fds = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]))
    return fds


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    control = socket.socket(fileno=spec["control_fd"])
    while True:
        try:
            msg, fds, _, _ = control.recvmsg(65536, socket.CMSG_LEN(4))
        except OSError:
            return 0
        got = _fds(fds)
        if not msg:
            return 0  # the trainer closed the relay, or died
        if not got:
            continue
        conn = Connection(socket.socket(fileno=got[0]), json.loads(msg), spec)
        threading.Thread(target=conn.run, name="relay-connection", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
