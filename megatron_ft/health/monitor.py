"""Heartbeats and failure classification (GEMINI section 6: the root agent and the health store).

Every agent writes ``hb/<node>`` = ``{"pid", "seq", "time"}`` every ``health.heartbeat_s`` (which
also re-publishes its keys on a new root after a failover, see :mod:`.store`). The root agent
watches all of them: a heartbeat that has not changed for ``health.timeout_s`` (measured on the
root's own monotonic clock, so clocks of different machines never matter) is a *hardware*
failure - the node's agent, and with it its memory, is gone - written to ``failed/<node>`` for
standby launchers and operators; a new heartbeat pid for that node clears it. A trainer that died
while its agent lives is a *software* failure: the agent reports it (``report_software``) and
recovery stays local.

    >>> classify(agent_alive=True, trainer_lost=True), classify(agent_alive=False, trainer_lost=True)
    ('software', 'hardware')
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Optional

log = logging.getLogger("megatron_ft.health")


def classify(agent_alive: bool, trainer_lost: bool) -> Optional[str]:
    """Software failure: the node (its agent, its memory) lives; hardware: it does not."""
    if not agent_alive:
        return "hardware"
    return "software" if trainer_lost else None


class Monitor:
    def __init__(self, store: Any, node: int, nodes: int, heartbeat_s: float, timeout_s: float):
        self.store, self.node, self.nodes = store, node, nodes
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self.seq = 0
        self.failed: dict[int, dict] = {}  # root's verdicts
        self._seen: dict[int, tuple[str, float]] = {}  # node -> (last heartbeat value, root time seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.seq += 1
                self.store.set(f"hb/{self.node}", json.dumps({"pid": os.getpid(), "seq": self.seq,
                                                              "time": time.time()}))
                if self.store.is_root:
                    self._watch()
            except Exception as e:  # the store may be failing over; try again next beat
                log.warning("node %d: heartbeat failed: %s", self.node, e)

    def _watch(self) -> None:
        now = time.monotonic()
        for n in range(self.nodes):
            if n == self.node:
                continue
            v = self.store.get(f"hb/{n}")
            if v is None:
                continue
            last = self._seen.get(n)
            if last is None or last[0] != v:
                self._seen[n] = (v, now)
                if n in self.failed and json.loads(v)["pid"] != self.failed[n]["pid"]:
                    log.warning("root: node %d is back (a replacement agent, pid %s)", n, json.loads(v)["pid"])
                    del self.failed[n]
                    self.store.delete(f"failed/{n}")
                continue
            if n not in self.failed and now - last[1] > self.timeout_s:
                verdict = {"node": n, "kind": classify(agent_alive=False, trainer_lost=True),
                           "pid": json.loads(v)["pid"], "detected_by": self.node, "time": time.time()}
                self.failed[n] = verdict
                self.store.set(f"failed/{n}", json.dumps(verdict))
                log.error("root: node %d missed heartbeats for %.1f s: hardware failure (agent and memory lost)",
                          n, now - last[1])

    def report_software(self, rank: int) -> None:
        """A local trainer died while this agent lives: a software failure (local recovery)."""
        try:
            self.store.set(f"software/{self.node}", json.dumps({"rank": rank, "time": time.time(),
                                                               "kind": classify(True, True)}))
        except Exception as e:
            log.warning("node %d: could not report the software failure of rank %d: %s", self.node, rank, e)

    def stop(self) -> None:
        self._stop.set()
