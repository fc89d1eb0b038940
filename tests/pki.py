"""Test certificates made at test time with ``cryptography`` (tests/serve/test_security.py shows
them in use): a CA, a server certificate for 127.0.0.1 and localhost, a client certificate, and
a rogue CA with a client certificate of its own."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib


def make_pki(out: pathlib.Path) -> dict[str, pathlib.Path]:
    """Write the PEM files into ``out``: name -> path for ca, server_cert, server_key,
    client_cert, client_key, rogue_cert, rogue_key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(k, filename):
        (out / filename).write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))

    def write_cert(c, filename):
        (out / filename).write_bytes(c.public_bytes(serialization.Encoding.PEM))

    def make_ca(cn):
        k = key()
        c = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn)).public_key(k.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
             .sign(k, hashes.SHA256()))
        return k, c

    def issue(ca_key, ca_cert, cn, usage, sans=None):
        k = key()
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject).public_key(k.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return k, b.sign(ca_key, hashes.SHA256())

    ca_key, ca = make_ca("batchd test CA")
    rogue_key, rogue_ca = make_ca("rogue CA")
    server_key, server = issue(ca_key, ca, "batchd server", ExtendedKeyUsageOID.SERVER_AUTH,
                               [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_key, client = issue(ca_key, ca, "trainer", ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue_client_key, rogue_client = issue(rogue_key, rogue_ca, "intruder", ExtendedKeyUsageOID.CLIENT_AUTH)
    write_cert(ca, "ca.pem")
    write_cert(server, "server.pem")
    write_key(server_key, "server.key")
    write_cert(client, "client.pem")
    write_key(client_key, "client.key")
    write_cert(rogue_client, "rogue.pem")
    write_key(rogue_client_key, "rogue.key")
    return {n: out / f for n, f in [("ca", "ca.pem"), ("server_cert", "server.pem"), ("server_key", "server.key"),
                                     ("client_cert", "client.pem"), ("client_key", "client.key"),
                                     ("rogue_cert", "rogue.pem"), ("rogue_key", "rogue.key")]}
