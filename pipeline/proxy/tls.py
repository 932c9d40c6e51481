"""HTTPS for the proxy, with vLLM's flags: --ssl-keyfile and --ssl-certfile
(both, or neither: plain HTTP), --ssl-ca-certs (the authorities client
certificates are checked against) and --ssl-cert-reqs (0: no client
certificate, the default; 1: checked if one is sent; 2: required), as
vllm serve passes them to uvicorn."""

from __future__ import annotations

import argparse
import ssl

CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssl-keyfile", metavar="FILE", help="the server's private key (PEM); with --ssl-certfile: HTTPS")
    p.add_argument("--ssl-certfile", metavar="FILE", help="the server's certificate chain (PEM)")
    p.add_argument("--ssl-ca-certs", metavar="FILE", help="authorities that sign client certificates (PEM)")
    p.add_argument("--ssl-cert-reqs", type=int, choices=sorted(CERT_REQS), default=None,
                   help="client certificates: 0 none (default), 1 checked if sent, 2 required")


def check_tls_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """p.error, in one line, for flags that cannot make a server."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        p.error("--ssl-keyfile and --ssl-certfile go together")
    if not args.ssl_certfile and (args.ssl_ca_certs or args.ssl_cert_reqs):
        p.error("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        p.error("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to check client certificates against")


def server_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The proxy's TLS context, or None for plain HTTP. OSError or
    ssl.SSLError for files that cannot be read as a key and its chain."""
    if not args.ssl_certfile:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    if args.ssl_ca_certs:
        context.load_verify_locations(args.ssl_ca_certs)
    context.verify_mode = CERT_REQS[args.ssl_cert_reqs or 0]
    return context
