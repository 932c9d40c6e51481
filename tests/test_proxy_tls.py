"""HTTPS with vLLM's flags (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs,
--ssl-cert-reqs): the proxy as its own process on the tiny model, with
certificates made here (an authority, a server's, a client's): a client
that trusts the authority is answered over HTTPS and plain HTTP is not;
with client certificates required, only a client holding one is answered;
the launcher's health check reads the status through TLS; epd-launch passes
the flags on with absolute paths; bad flags and bad files are one line."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conftest import REPO
from stack import free_port
from waiting import until


def _issue(name: str, issuer=None, *, ca: bool = False, server: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = (issuer[0].subject, issuer[1]) if issuer else (subject, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                        critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


def _write(folder, name: str, cert, key) -> tuple[str, str]:
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    authority = _issue("test authority", ca=True)
    return {"ca": _write(folder, "ca", *authority)[0],
            "server": _write(folder, "server", *_issue("127.0.0.1", authority, server=True)),
            "client": _write(folder, "client", *_issue("a client", authority))}


def _proxy(tiny_dir, tmp_path, port: int, *tls: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stages.proxy", "--model", str(tiny_dir), "--model-id", "tiny",
                             "--mode", "aggregated", "--generators", f"ipc://{tmp_path}/nobody.sock",
                             "--address", f"ipc://{tmp_path}/proxy.sock", "--port", str(port), *tls],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _answer(url: str, ca: str | None = None, client: tuple[str, str] | None = None):
    """The reply to a GET from a client that trusts `ca` (None: the system's
    authorities only) and holds `client` (cert, key), or None: no answer."""
    context = ssl.create_default_context(cafile=ca)
    if client:
        context.load_cert_chain(*client)
    try:
        return httpx.get(url, timeout=2.0, verify=context if url.startswith("https") else True)
    except httpx.HTTPError:
        return None


def test_the_proxy_serves_https_and_not_plain_http(tiny_dir, tmp_path, certs):
    from pipeline.launch.supervisor import _health_status

    port = free_port()
    cert, key = certs["server"]
    proc = _proxy(tiny_dir, tmp_path, port, "--ssl-certfile", cert, "--ssl-keyfile", key)
    try:
        reply = until(lambda: _answer(f"https://127.0.0.1:{port}/v1/models", ca=certs["ca"]), "the HTTPS proxy")
        assert reply.status_code == 200 and reply.json()["data"][0]["id"] == "tiny"
        assert _answer(f"http://127.0.0.1:{port}/v1/models") is None   # plain HTTP gets no answer
        assert _answer(f"https://127.0.0.1:{port}/v1/models") is None   # nor a client that trusts nobody here
        assert _health_status(f"https://127.0.0.1:{port}/health") == 503   # the launcher reads it: no generator
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_client_certificates_when_required(tiny_dir, tmp_path, certs):
    port = free_port()
    cert, key = certs["server"]
    proc = _proxy(tiny_dir, tmp_path, port, "--ssl-certfile", cert, "--ssl-keyfile", key,
                  "--ssl-ca-certs", certs["ca"], "--ssl-cert-reqs", "2")
    url = f"https://127.0.0.1:{port}/v1/models"
    try:
        until(lambda: _answer(url, ca=certs["ca"], client=certs["client"]), "the HTTPS proxy")
        assert _answer(url, ca=certs["ca"]) is None   # no client certificate: refused in the handshake
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_bad_flags_and_files_are_one_line(tiny_dir, tmp_path, certs):
    cert, key = certs["server"]
    for flags, says in ((["--ssl-certfile", cert], "go together"),
                        (["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
                        (["--ssl-certfile", cert, "--ssl-keyfile", certs["ca"]], "error")):
        proc = _proxy(tiny_dir, tmp_path, free_port(), *flags)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and says in err and len(err.strip().splitlines()) == 1, err


def test_epd_launch_passes_the_flags_on(tiny_dir, tmp_path, certs, monkeypatch):
    from pipeline.launch import cli
    from pipeline.launch.plan import HostFacts, http_url, plan_stages
    from stages.proxy import parse_args as proxy_args

    cert, key = certs["server"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ca.pem").write_text(open(certs["ca"]).read())
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", "--ssl-certfile", cert, "--ssl-keyfile", key,
                           "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "1"])
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    proxy = proxy_args(list(next(s for s in specs if s.role == "proxy").args))
    assert (proxy.ssl_certfile, proxy.ssl_keyfile) == (cert, key) and proxy.ssl_cert_reqs == 1
    assert proxy.ssl_ca_certs == str(tmp_path / "ca.pem")   # made absolute
    assert http_url("0.0.0.0", 8443, "/health", for_client=True, tls=True) == "https://127.0.0.1:8443/health"
    refused = subprocess.run([sys.executable, str(REPO / "bin" / "epd-launch"), str(tiny_dir), "--device", "cpu",
                              "--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", certs["ca"],
                              "--ssl-cert-reqs", "2"], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "client certificate" in refused.stderr
