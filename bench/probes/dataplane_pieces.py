"""The data plane's pieces alone: what receiving a batch costs the trainer, and sending it the server.

    python -m bench.probes.dataplane_pieces [--quick] [--repeats N]

A server process (spawned: a ``DataPlane`` and a ``SlotPool`` slot holding one 64 x 224 x 224 x 3
uint8 batch, 9.6 MB, and an int64 label [64]) sends ``BATCHES`` batches as fast as the client
takes them over loopback; this process receives them with ``DataSocket.receive`` into a reused
``BufferPool`` buffer, reads one byte per page of the image (``bench.measure.consume``) and drops
the batch. Per mode (plain TCP, TLS 1.3 with an ECDSA P-256 certificate), alternated, median of
the rounds: the receiving process's CPU (user + system, all its threads, from
/proc/PID/task/*/schedstat) and the server process's, in seconds per GB of payload, and GB/s.
No gRPC is involved: bench/tables/table_network.py measures the whole path.

The design figures this checks (docs/design/network-path.md): plain ``recv_into`` 0.09 s/GB,
TLS 0.47 s/GB in the trainer; the server's send <= 0.3 s/GB.
"""

from __future__ import annotations

import datetime
import multiprocessing
import pathlib
import sys
import tempfile
import time


from bench import common
from bench.measure import consume, cpu_seconds, median
from bench.noise import measure
from bench.report import md_table

NAME = "dataplane"
TITLE = "Data plane pieces: trainer and server CPU per GB received over one data connection (loopback)"
SHAPE = (64, 224, 224, 3)
MODES = ("plain", "tls")


def self_signed(out: pathlib.Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (PEM files in ``out``), signed by itself."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "batchd bench")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (out / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    return str(out / "cert.pem"), str(out / "key.pem")


def _serve(pipe, cert: str | None, key: str | None) -> None:
    """The server process: for each count it is sent, one connection's worth of that many batches
    from one slot; sends back its CPU seconds. None ends it."""
    import os

    import numpy as np

    from batchd import datawire
    from batchd.server.config import TlsConfig
    from batchd.server.serve.dataplane import DataPlane, tls_context
    from batchd.server.shm import Owner, SlotPool

    owner = Owner()
    slots = SlotPool(max_slots=2, prefix=owner.prefix)
    image = int(np.prod(SHAPE))
    slot = slots.acquire(image + 4096)
    slot.buf[: image + 4096] = np.random.default_rng(0).integers(0, 256, image + 4096, dtype=np.uint8).tobytes()
    pieces, length = datawire.payload_layout([(0, 64 * 8), (4096, image)])
    ctx = tls_context(TlsConfig(cert=cert, key=key)) if cert else None
    plane = DataPlane("127.0.0.1", 0, ssl_context=ctx)
    try:
        while True:
            batches = pipe.recv()
            if batches is None:
                break
            ticket = plane.expect()
            pipe.send((plane.port, ticket.token, pieces, length))
            connection = ticket.wait()
            c0 = cpu_seconds(os.getpid())
            for b in range(batches):
                connection.send(b, slot, pieces, length)
            c1 = cpu_seconds(os.getpid())
            pipe.recv()  # the client has read everything
            connection.close()
            pipe.send(c1 - c0)
    finally:
        plane.close()
        slots.close()
        owner.close()


def _receive(pipe, mode: str, cert: str | None, batches: int) -> dict:
    import os

    from batchd import wire
    from batchd.client.transport import buffers
    from batchd.client.transport.channel import TLS
    from batchd.client.transport.dataplane import DataSocket

    pipe.send(batches)
    port, token, pieces, length = pipe.recv()
    tensors = (wire.WireTensor("label", "int64", (64,), offset=pieces[0].offset),
               wire.WireTensor("image", "uint8", SHAPE, offset=pieces[1].offset))
    pool = buffers.BufferPool()
    tls = TLS(ca=cert) if mode == "tls" else None
    with DataSocket.connect(f"127.0.0.1:{port}", port, token, tls=tls) as ds:
        c0, t0 = cpu_seconds(os.getpid()), time.perf_counter()
        for b in range(batches):
            batch = ds.receive(wire.WireBatch(b, 0, batches, tensors), pool)
            consume(batch)
            del batch
        c1, t1 = cpu_seconds(os.getpid()), time.perf_counter()
        pipe.send("done")
        server = pipe.recv()
    gb = batches * length / 1e9
    return {"trainer": (c1 - c0) / gb, "server": server / gb, "gbps": gb / (t1 - t0)}


def run(s, log=print) -> dict:
    batches = s.pick(300, 60)
    rounds = s.pick(5, 2) if s.repeats <= 1 else s.repeats
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    servers, pipes = {}, {}
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = self_signed(pathlib.Path(tmp))
        try:
            for mode in MODES:
                pipes[mode], child = ctx.Pipe()
                servers[mode] = ctx.Process(target=_serve, args=(child, cert if mode == "tls" else None, key))
                servers[mode].start()
                _receive(pipes[mode], mode, cert, 5)  # warm-up: imports, buffers, page cache
            for r in range(rounds):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    results[mode].append(measure(lambda: _receive(pipes[mode], mode, cert, batches)))
                log(f"  dataplane: round {r + 1}/{rounds} done")
        finally:
            for mode, server in servers.items():
                try:
                    pipes[mode].send(None)
                except OSError:
                    pass
                server.join(10)
                if server.exitcode is None:
                    server.kill()
    rows = {m: {k: median(x[k] for x in results[m]) for k in ("trainer", "server", "gbps")} for m in MODES}
    return {"rows": rows, "batches": batches, "rounds": rounds}


def render(r: dict) -> str:
    head = ["connection", "trainer CPU s/GB", "server CPU s/GB", "GB/s"]
    rows = [[m, f"{x['trainer']:.3f}", f"{x['server']:.3f}", f"{x['gbps']:.2f}"] for m, x in r["rows"].items()]
    return md_table(head, rows) + (
        f"\n\n{r['batches']} batches of 9.6 MB per round, median of {r['rounds']} alternated rounds; CPU of all "
        "threads of each process (the trainer's includes reading one byte per page of each batch).")


def targets(r: dict) -> list[dict]:
    plain, tls = r["rows"]["plain"], r["rows"]["tls"]
    return [
        {"name": "plain: trainer <= 0.2 s/GB", "passed": plain["trainer"] <= 0.2, "detail": f"{plain['trainer']:.3f}"},
        {"name": "plain: server <= 0.3 s/GB", "passed": plain["server"] <= 0.3, "detail": f"{plain['server']:.3f}"},
        {"name": "TLS: trainer below today's inline gRPC (0.92 s/GB, issue 28)", "passed": tls["trainer"] < 0.92,
         "detail": f"{tls['trainer']:.3f} (design note: 0.47, the decryption's cost)"},
    ]


def main(argv=None) -> int:
    return common.table_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
