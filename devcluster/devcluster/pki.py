"""The cluster's credentials: a CA, the API server's serving and kubelet-client certificates, the
service-account key pair, the admin token, the audit policy, and the admin kubeconfig. openssl only;
nothing here starts a process.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import node

from devcluster.config import HOST, TOKEN_USER, ClusterError


def openssl(*args: str, cwd: Path) -> None:
    if not shutil.which("openssl"):
        raise ClusterError(
            "openssl not found: install Debian's `openssl` package (apt-get install -y openssl)."
        )
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(pki: Path) -> str:
    """A CA, the API server's serving certificate, the service-account key pair and an admin token."""
    pki.mkdir(parents=True, exist_ok=True)
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=rlhf-local-ca",
        cwd=pki,
    )
    (pki / "server.ext").write_text(
        f"subjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:{node.GATEWAY},DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
        "extendedKeyUsage=serverAuth\n"
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=kube-apiserver",
        cwd=pki,
    )
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "3650",
        "-extfile",
        "server.ext",
        cwd=pki,
    )
    # The API server's client certificate for the kubelet (logs, exec): the kubelet trusts our CA only.
    (pki / "kubelet-client.ext").write_text("extendedKeyUsage=clientAuth\n")
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "kubelet-client.key", "-out", "kubelet-client.csr",
        "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client", cwd=pki,
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", "kubelet-client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "kubelet-client.crt", "-days", "3650", "-extfile", "kubelet-client.ext", cwd=pki,
    )  # fmt: skip
    openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    token = base64.urlsafe_b64encode(os.urandom(24)).decode().rstrip("=")
    (pki / "tokens.csv").write_text(f'{token},{TOKEN_USER},1000,"system:masters"\n')
    (pki / "audit-policy.yaml").write_text(
        "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n"
        "- level: Metadata\n  verbs: [create, update, patch, delete, deletecollection]\n"
        "- level: None\n"
    )
    return token


def write_kubeconfig(path: Path, ca: Path, token: str, port: int) -> None:
    ca_data = base64.b64encode(ca.read_bytes()).decode()
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "rlhf-local",
                        "cluster": {
                            "server": f"https://{HOST}:{port}",
                            "certificate-authority-data": ca_data,
                        },
                    }
                ],
                "users": [{"name": TOKEN_USER, "user": {"token": token}}],
                "contexts": [
                    {"name": "rlhf-local", "context": {"cluster": "rlhf-local", "user": TOKEN_USER}}
                ],
                "current-context": "rlhf-local",
            },
            indent=2,
        )
    )
    path.chmod(0o600)
