"""The scale bed's process plumbing, shared by its agents' workers (:mod:`.scale_bed`) and its launcher/keeper
side (:mod:`.scale_health`): the descriptor limit raised, and the coordinator's handle on one worker process
(one JSON line per command and per answer on its stdin/stdout, every wait bounded)."""
from __future__ import annotations

import json
import queue
import resource
import subprocess
import threading
import time
from typing import Optional


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]



# ---------------------------------------------------------------------------------------- the coordinator
class BedError(RuntimeError):
    pass


class _Proc:
    def __init__(self, popen: subprocess.Popen, first: int, last: int, log_path: str):
        self.popen, self.first, self.last, self.log_path = popen, first, last, log_path
        self.lines: "queue.Queue[Optional[dict]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:  # type: ignore[union-attr]
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                pass
        self.lines.put(None)

    def send(self, obj: dict) -> None:
        self.popen.stdin.write(json.dumps(obj) + "\n")  # type: ignore[union-attr]
        self.popen.stdin.flush()  # type: ignore[union-attr]

    def recv(self, timeout_s: float, event: Optional[str] = None) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise BedError(f"worker of nodes {self.first}-{self.last - 1} said nothing within {timeout_s:g} s"
                               f"{self.tail()}") from None
            if msg is None:
                raise BedError(f"worker of nodes {self.first}-{self.last - 1} ended (exit {self.popen.poll()})"
                               f"{self.tail()}")
            if msg.get("event") == "error":
                raise BedError(f"worker of nodes {self.first}-{self.last - 1}: {msg['error']}{self.tail()}")
            if event is None or msg.get("event") == event:
                return msg

    def tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                text = f.read()[-n:]
            return f"\n--- its log ---\n{text}" if text.strip() else ""
        except OSError:
            return ""
