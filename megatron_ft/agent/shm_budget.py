"""The node's shared-memory budget: its slots (allocated, and being allocated outside the slot
store's lock) and the reservation for the blocks it holds for its peers, counted in
``agent.shm_limit_mib`` and against the free space of ``agent.shm_dir``.

Owns its own lock, innermost: taken alone or under ``SlotStore.lock``, nothing is taken under it;
no I/O but a statvfs of ``agent.shm_dir``. Not collective.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

from . import shm
from .block_store import MAX_VERSIONS as MAX_BLOCK_VERSIONS
from .. import config as ftconfig

log = logging.getLogger("megatron_ft.agent")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class ShmBudget:
    """One node's budget (see the module). ``refusal``: why its peers' blocks do not fit ("" when they
    do); every ``begin`` of the node's trainers is refused with it."""

    def __init__(self, cfg: ftconfig.FTConfig, node: int):
        self.cfg, self.node = cfg, node
        self.limit = cfg.agent.shm_limit_mib << 20  # 0: none
        self.lock = threading.Lock()
        self._allocated: dict[int, int] = {}  # rank -> bytes of its slots
        self._reserved: dict[int, int] = {}  # rank -> bytes being allocated for it (outside the slot store's lock)
        self._peer_reserved = 0  # shared memory this node's blocks for its group take at most
        self.refusal = ""

    def slot_bytes(self) -> int:
        """Shared memory of the slots, allocated or being allocated."""
        with self.lock:
            return sum(self._allocated.values()) + sum(self._reserved.values())

    def reserve_slots(self, rank: int, nbytes: int) -> Optional[int]:
        """Reserve ``nbytes`` for ``rank``'s new slots (its old ones already released); what is left of
        ``agent.shm_limit_mib`` for them (None: no limit). Released by :meth:`slots_done`."""
        with self.lock:
            used = sum(self._allocated.values()) + sum(self._reserved.values()) + self._peer_reserved
            self._reserved[rank] = nbytes
            return max(0, self.limit - used) if self.limit else None

    def slots_done(self, rank: int, allocated: Optional[int]) -> None:
        """``rank``'s reservation ends: ``allocated`` bytes of slots exist for it (None: none were made)."""
        with self.lock:
            self._reserved.pop(rank, None)
            if allocated is not None:
                self._allocated[rank] = allocated

    def slots_dropped(self, rank: int) -> None:
        with self.lock:
            self._allocated.pop(rank, None)

    def reserve_peer_blocks(self, need: int, blocks: int, allocated: int) -> None:
        """Count ``need`` bytes - every version of the ``blocks`` this node holds for its group, of
        which ``allocated`` exist already - in ``agent.shm_limit_mib`` and against the free space of
        ``agent.shm_dir``, once the group's container sizes are known and before any of them is sent or
        received. When it does not fit, a :class:`~.shm.SharedMemoryError` naming both numbers and the
        fix, and :attr:`refusal` says it to every later ``begin`` of this node's trainers (a trainer
        with ``agent.required`` ends the job: exit 2)."""
        d = self.cfg.agent.shm_dir
        versions = MAX_BLOCK_VERSIONS + self.cfg.recovery.marked_versions
        with self.lock:
            slots = sum(self._allocated.values()) + sum(self._reserved.values())
            what = (f"node {self.node}'s blocks for its peers ({self.cfg.redundancy.scheme}: {blocks} block(s), "
                    f"{versions} versions each) need {_mib(need)} of shared memory beside its slots' {_mib(slots)}")
            problem = ""
            if self.limit and slots + need > self.limit:
                problem = (f"{what}, {_mib(slots + need)} in all, but agent.shm_limit_mib={self.cfg.agent.shm_limit_mib}: "
                           f"raise it to at least {-(-(slots + need) // 2**20)}")
            else:
                free = shm.shm_free_bytes(d) - sum(self._reserved.values())
                if need - allocated > free:
                    problem = (f"{what}, but {d} has {_mib(free)} free: give it at least {_mib(need - allocated - free)} "
                               f"more (docker --shm-size, a Kubernetes emptyDir with medium: Memory and a larger "
                               f"sizeLimit) or point agent.shm_dir at a larger tmpfs")
            if not problem:
                self._peer_reserved, self.refusal = need, ""
                return
            said, self.refusal = self.refusal, f"shared memory too small: {problem}"
        if said != self.refusal:  # once (every peer's put asks again)
            log.error("agent node %d: %s", self.node, self.refusal)
        raise shm.SharedMemoryError(self.refusal)

    def status(self) -> dict:
        with self.lock:
            slots = sum(self._allocated.values()) + sum(self._reserved.values())
            return {"slots": slots, "peer_blocks_reserved": self._peer_reserved, "limit": self.limit,
                    "refused": self.refusal}
