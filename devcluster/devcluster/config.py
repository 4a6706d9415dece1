"""Where the control plane lives and the names it is known by: the checkout, the Go wrapper modules,
the state directory (RLHF_CLUSTER_DIR, read once at import), the binary cache, and the error a user can
act on. Nothing here starts, builds or reads anything.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GO_DIR = ROOT / "devcluster" / "go"
STATE = Path(os.environ.get("RLHF_CLUSTER_DIR", ROOT / ".cluster"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlhf-operator"

KUBERNETES_VERSION = "v1.36.3"
HOST = "127.0.0.1"
TOKEN_USER = "rlhf-admin"


class ClusterError(RuntimeError):
    """A failure the user can act on; the message says what and how."""
