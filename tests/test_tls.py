"""TLS and SuperNode authentication end to end on loopback, with certificates and keys made by the test.

A CA, a server certificate for 127.0.0.1/localhost and one SuperNode EC key pair (OpenSSH format, NIST P-384)
are generated with ``cryptography``. ``flower-server --ssl-certfile/--ssl-keyfile/--ssl-ca-certfile
--auth-supernode-key PUB`` starts the SuperLink with TLS and ``--enable-supernode-auth`` and registers the key
(``flwr supernode register``); ``flower-client --root-certificates CA --auth-supernode-private-key KEY`` connects.
The run must finish; plain HTTP must be refused on the same port.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedcomp.tools.processes import ManagedProcess, free_port, signal_pids
from tests.test_deployment import FINISH_S, RUN_BOUNDS, command, read_rows, wait_for

ROOT = Path(__file__).resolve().parents[1]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(folder: Path) -> dict[str, Path]:
    """CA, server certificate (SAN 127.0.0.1, localhost) and a SuperNode auth key pair; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("fedcomp test CA"))
        .issuer_name(_name("fedcomp test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    node_key = ec.generate_private_key(ec.SECP384R1())
    paths = {
        k: folder / n
        for k, n in {
            "ca": "ca.crt",
            "cert": "server.pem",
            "key": "server.key",
            "node": "node_key",
            "node_pub": "node_key.pub",
        }.items()
    }
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths["node"].write_bytes(
        node_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
    )
    paths["node_pub"].write_bytes(
        node_key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    for p in paths.values():
        os.chmod(p, 0o600)
    return paths


@pytest.mark.slow
def test_tls_and_supernode_auth_end_to_end(tmp_path):
    pki = make_pki(tmp_path / "pki")
    port, out = free_port(), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started: list[ManagedProcess] = []
    try:
        server_argv = [*command("server_app.launcher", "flower-server"), "--port", str(port)]
        server_argv += ["--ssl-certfile", str(pki["cert"]), "--ssl-keyfile", str(pki["key"])]
        server_argv += ["--ssl-ca-certfile", str(pki["ca"]), "--auth-supernode-key", str(pki["node_pub"])]
        server_argv += ["--mode", "async", "--versions", "2", "--buffer-size", "1", "--min-clients", "1"]
        server_argv += ["--local-steps", "5", "--out", str(out), "--flwr-home", str(tmp_path / "home"), "--quiet"]
        server_argv += [*RUN_BOUNDS]
        server = ManagedProcess("server", server_argv, tmp_path / "server.log", env, cwd=ROOT)
        started.append(server)
        wait_for(lambda: "registered SuperNode key" in server.tail(200), server, "the key registration")
        with pytest.raises(httpx.HTTPError):  # TLS only: plain HTTP on the same port is refused
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=3)
        client_argv = [*command("clients.launcher", "flower-client"), "--server", f"127.0.0.1:{port}"]
        client_argv += ["--root-certificates", str(pki["ca"]), "--auth-supernode-private-key", str(pki["node"])]
        client_argv += ["--partition-id", "0", "--num-partitions", "1", "--flwr-home", str(tmp_path / "client")]
        started.append(ManagedProcess("client", client_argv, tmp_path / "client.log", env, cwd=ROOT))
        rc = server.proc.wait(timeout=FINISH_S)
        assert rc == 0, server.tail(60) + "\n" + started[1].tail(30)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["versions"] == 2 and [r["version"] for r in read_rows(out / "metrics.jsonl")] == [1, 2]
        print("\nTLS", json.dumps({k: summary[k] for k in ("versions", "accuracy", "wall_s")}))
    finally:
        for p in reversed(started):
            p.stop()
        signal_pids([pid for p in started for pid in p.known], 9)
