#!/usr/bin/env python3
"""The local control plane: real etcd, kube-apiserver, controller-manager, scheduler, KWOK and KubeRay.

Builds each component from the Go module proxy (cached under the user's cache directory), starts them
as background processes on loopback, and tears them down. Standard library only, so it runs before
the project's virtualenv exists. It never downloads a release binary.

    python3 devcluster/devcluster.py build|up|down|status|env|restart|kueue-up|kueue-down

kueue-up starts Kueue (issue 16) in a running control plane; kueue-down stops it and removes its webhooks.
The code is the package beside this script (devcluster/devcluster/, whose docstring maps its modules);
this file is only its entry point, so every caller keeps this path.
"""

import sys

from devcluster.cli import main  # the package devcluster/devcluster/: a package wins over this file

if __name__ == "__main__":
    sys.exit(main())
