"""Process lifetimes on a node: nothing outlives the process that started it."""
from __future__ import annotations

import ctypes
import signal


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux prctl
    PR_SET_PDEATHSIG; a no-op elsewhere). The launcher's torchrun, the pool, its keepers and
    trainers all use it, so nothing outlives the process that started it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def set_process_name(name: str) -> None:
    """The name ``ps``/psutil show for this process (``/proc/PID/comm``, Linux PR_SET_NAME; 15
    bytes at most; a no-op elsewhere)."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME = 15
    except (OSError, AttributeError):
        pass
