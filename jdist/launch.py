"""``python -m jdist.launch --nproc N [--devices-per-proc K] script.py args...``.

Starts N local workers of a `jdist.MultiWorkerMirroredStrategy` job; see
:mod:`jdist._src.multi_worker.launcher` and ``docs/multi_worker.md``.
"""

import sys

from jdist._src.multi_worker.launcher import free_ports
from jdist._src.multi_worker.launcher import main
from jdist._src.multi_worker.launcher import worker_env

__all__ = ("free_ports", "main", "worker_env")

if __name__ == "__main__":
    sys.exit(main())
