"""The job record: who owns each node, which nodes the root judged lost, how the job ended, and the
published rendezvous - one record kept by the store, read by the launchers, the standbys and an
orphaned agent instead of every node's keys.

Its sources are the keys the job writes anyway: ``hb/<n>`` (only the owners matter here: the agent's
pid, its launcher's pid, ``trained``; a heartbeat that changes none of them changes nothing),
``failed/<n>`` (the root's verdict, set and deleted), ``fatal/<n>`` (a launcher ending the job:
``{"format": "megatron-ft-fatal/1", "node", "code", "message"}``), ``ended`` (a launcher's end) and
``rdzv`` (the rendezvous generation). :func:`apply` folds one key's change into a :class:`JobRecord`
(no I/O; it returns the parts it changed).

**Embedded store.** The root's server folds every such ``set`` and ``delete`` in process, under its
map's lock (:meth:`~megatron_ft.health.wire_store.KVServer.derive`, :class:`RecordKeeper`), and
stores the record as keys a reader fetches only when they changed:

==================  ==========================================================================
key                 value (JSON)
==================  ==========================================================================
``job/events``      ``{"format": "megatron-ft-job/1", "epoch", "version", "ended", "fatal",
                    "rdzv", "failed": [version of each failed part]}``: changes only with a
                    verdict, a fatal record, an end or a rendezvous (what the waiters wait for)
``job/owners``      ``{"format": "megatron-ft-job-owners/1", "epoch", "version", "complete",
                    "parts": [version of each owners part]}`` (``complete``: how many nodes have
                    an agent and a launcher)
``job/owners/<p>``  ``{"format": "megatron-ft-job-part/1", "epoch", "kind": "owners", "part",
                    "version", "nodes": {"<n>": [agent, launcher, trained]}}``
``job/failed/<p>``  the same with ``"kind": "failed"`` and ``{"<n>": [agent pid, verdict time]}``
==================  ==========================================================================

Part ``p`` holds nodes ``[p * PART_NODES, (p + 1) * PART_NODES)``: at most 24 KiB at its largest
(:func:`largest_part_bytes`; the store's values may be 64 KiB), 4 parts of each kind at 2,048 nodes,
32 at 16,384. ``epoch`` names the root that keeps the record (a new root after a failover starts a new
one, re-filled within a heartbeat by the agents' heartbeats; verdicts, fatal records and ``ended``
live in the root's map like every unpublished key and go with it).

**Readers** (:class:`JobView`): ``wait(after, wait_s)`` is one long poll (the store's ``watch``) on
``job/events``, then a read of each part whose version changed; ``refresh(owners=True)`` adds
``job/owners`` and its changed parts. A reader's requests per change are 1 + the parts changed,
whatever N: a standby waits on one request per change or per ``wait_s``; a launcher reads the owners
once when it starts (ceil(N / 512) parts) and then the changed parts only.

**etcd** has no derived keys: :class:`~megatron_ft.health.job_view_etcd.EtcdJobView` reads the keys
once (one range read) and folds etcd's own events of them, one watch stream, client-side.

    >>> r = JobRecord(nodes=3)
    >>> sorted(apply(r, "hb/1", '{"pid": 10, "launcher": 20, "trained": false, "seq": 1}'))
    [('owners', 0)]
    >>> apply(r, "hb/1", '{"pid": 10, "launcher": 20, "trained": false, "seq": 2}')  # a beat: nothing new
    set()
    >>> sorted(apply(r, "failed/1", '{"pid": 10, "time": 5.5, "why": "missed heartbeats"}'))
    [('events', 0), ('failed', 0)]
    >>> r.failed[1], r.owners[1]
    (Failed(pid=10, time=5.5), Owners(agent=10, launcher=20, trained=False))
    >>> sorted(apply(r, "failed/1", None)), r.failed
    ([('events', 0), ('failed', 0)], {})
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..clock import Deadline
from .kv import StoreUnavailable

log = logging.getLogger("megatron_ft.health")

FORMAT = "megatron-ft-job/1"
OWNERS_FORMAT = "megatron-ft-job-owners/1"
PART_FORMAT = "megatron-ft-job-part/1"
FATAL_FORMAT = "megatron-ft-fatal/1"
EVENTS_KEY = "job/events"
OWNERS_KEY = "job/owners"
#: nodes per part
PART_NODES = 512
#: the longest fatal message the record carries (the key ``fatal/<n>`` and the node's fatal.json keep it all)
MESSAGE_MAX = 2000
#: the keys the record is made of (their prefixes), and on etcd the one key range that holds them all
#: (``ended`` .. ``rdzv``: also ``hang``, ``job/`` and ``last_verdict``, which the fold ignores)
SOURCES = ("hb/", "failed/", "fatal/", "ended", "rdzv")
RANGE = ("ended", "rdzv\0")


def part_key(kind: str, part: int) -> str:
    return f"job/{kind}/{part}"


def parts_of(nodes: int) -> int:
    return max(1, math.ceil(nodes / PART_NODES))


@dataclass(frozen=True)
class Owners:
    """The processes that make a node what it is: its agent, the launcher owning it (0: none now), and
    whether a trainer ever registered with the agent."""
    agent: int
    launcher: int
    trained: bool = False


@dataclass(frozen=True)
class Failed:
    """The root's verdict on a node, as a standby claims it (:func:`~.monitor.claim_key`): the judged
    agent's pid and the verdict's time (the full record stays in ``failed/<n>``)."""
    pid: int
    time: float

    def claim_fields(self) -> dict:
        return {"pid": self.pid, "time": self.time}


@dataclass(frozen=True)
class Fatal:
    node: int
    code: int
    message: str


@dataclass(frozen=True)
class Ended:
    node: int
    rc: Optional[int]
    time: float


@dataclass
class JobRecord:
    """The record (see the module). ``version`` counts the changes folded into it."""
    nodes: int
    epoch: str = ""
    version: int = 0
    owners: dict[int, Owners] = field(default_factory=dict)
    failed: dict[int, Failed] = field(default_factory=dict)
    fatal: dict[int, Fatal] = field(default_factory=dict)
    ended: Optional[Ended] = None
    rdzv: Optional[str] = None

    def first_fatal(self) -> Optional[Fatal]:
        """The lowest-numbered node that ended the job (None: none did)."""
        return self.fatal[min(self.fatal)] if self.fatal else None

    def complete(self) -> int:
        """How many nodes have an agent and a launcher."""
        return sum(1 for o in self.owners.values() if o.agent and o.launcher)


def _node(key: str, prefix: str, nodes: int) -> Optional[int]:
    try:
        n = int(key[len(prefix):])
    except ValueError:
        return None
    return n if 0 <= n < nodes else None


def _complete_in(raw: Optional[str]) -> int:
    """The ``complete`` count of a ``job/owners`` index (0: none, or not an index of this format)."""
    idx = _json(raw) if raw is not None else None
    return int(idx.get("complete", 0)) if idx is not None and idx.get("format") == OWNERS_FORMAT else 0


def _json(value: str) -> Optional[dict]:
    try:
        rec = json.loads(value)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def apply(rec: JobRecord, key: str, value: Optional[str]) -> set[tuple[str, int]]:
    """Fold one change of ``key`` (under the job's prefix; ``value`` None: deleted) into ``rec`` in place;
    returns the parts it changed: ``("owners", p)``, ``("failed", p)``, ``("events", 0)``. Keys of no
    node in ``range(rec.nodes)``, other keys and unreadable values change nothing. No I/O: the root's
    store calls it under its map's lock, a reader on etcd with each event."""
    changed: set[tuple[str, int]] = set()
    if key.startswith("hb/"):
        n = _node(key, "hb/", rec.nodes)
        hb = _json(value) if n is not None and value is not None else None
        if hb is None:
            return changed
        try:
            new = Owners(int(hb["pid"]), int(hb.get("launcher", 0) or 0), hb.get("trained") is True)
        except (KeyError, TypeError, ValueError):
            return changed
        if rec.owners.get(n) != new:
            rec.owners[n] = new
            changed.add(("owners", n // PART_NODES))
    elif key.startswith("failed/"):
        n = _node(key, "failed/", rec.nodes)
        if n is None:
            return changed
        new_failed: Optional[Failed] = None
        if value is not None:
            v = _json(value)
            try:
                new_failed = Failed(int(v["pid"]), float(v["time"])) if v is not None else None
            except (KeyError, TypeError, ValueError):
                new_failed = None
            if new_failed is None:
                return changed
        if rec.failed.get(n) != new_failed:
            if new_failed is None:
                del rec.failed[n]
            else:
                rec.failed[n] = new_failed
            changed |= {("failed", n // PART_NODES), ("events", 0)}
    elif key.startswith("fatal/"):
        n = _node(key, "fatal/", rec.nodes)
        v = _json(value) if n is not None and value is not None else None
        if v is None or v.get("format") != FATAL_FORMAT:
            return changed
        code = v.get("code")
        new_fatal = Fatal(n, code if isinstance(code, int) else 2, str(v.get("message", ""))[:MESSAGE_MAX])
        if rec.fatal.get(n) != new_fatal:
            rec.fatal[n] = new_fatal
            changed.add(("events", 0))
    elif key == "ended":
        v = _json(value) if value is not None else None
        try:
            new_end = Ended(int(v.get("node", -1)), v.get("rc"), float(v.get("time", 0))) if v else None
        except (TypeError, ValueError):
            new_end = None
        # the latest end: a store that outlives jobs (etcd) may hold an earlier job's, which a reader
        # tells apart by its time
        if new_end is not None and (rec.ended is None or new_end.time >= rec.ended.time) and rec.ended != new_end:
            rec.ended = new_end
            changed.add(("events", 0))
    elif key == "rdzv":
        if rec.rdzv != value:
            rec.rdzv = value
            changed.add(("events", 0))
    if changed:
        rec.version += 1
    return changed


# ---------------------------------------------------------------------------------------------- codec

def encode_part(rec: JobRecord, kind: str, part: int, version: int) -> str:
    """Part ``part`` of ``kind`` (``owners`` or ``failed``) as stored."""
    lo, hi = part * PART_NODES, min(rec.nodes, (part + 1) * PART_NODES)
    if kind == "owners":
        nodes = {str(n): [o.agent, o.launcher, int(o.trained)] for n, o in sorted(rec.owners.items()) if lo <= n < hi}
    else:
        nodes = {str(n): [f.pid, f.time] for n, f in sorted(rec.failed.items()) if lo <= n < hi}
    return json.dumps({"format": PART_FORMAT, "epoch": rec.epoch, "kind": kind, "part": part, "version": version,
                       "nodes": nodes}, separators=(",", ":"))


def decode_part(text: str, kind: str, part: int, nodes: int) -> tuple[str, int, dict[int, Any]]:
    """(epoch, version, entries) of a stored part; a ValueError naming what is wrong otherwise."""
    rec = _json(text)
    if rec is None or rec.get("format") != PART_FORMAT or rec.get("kind") != kind or rec.get("part") != part:
        raise ValueError(f"job record part {kind}/{part} is not a {PART_FORMAT} {kind} part: {text[:120]!r}")
    out: dict[int, Any] = {}
    lo, hi = part * PART_NODES, min(nodes, (part + 1) * PART_NODES)
    for k, v in rec.get("nodes", {}).items():
        n = int(k)
        if not lo <= n < hi:
            raise ValueError(f"job record part {kind}/{part} names node {n}, outside [{lo}, {hi})")
        out[n] = Owners(int(v[0]), int(v[1]), bool(v[2])) if kind == "owners" else Failed(int(v[0]), float(v[1]))
    return str(rec.get("epoch", "")), int(rec.get("version", 0)), out


def encode_events(rec: JobRecord, failed_versions: list[int]) -> str:
    f = rec.first_fatal()
    e = rec.ended
    return json.dumps({"format": FORMAT, "epoch": rec.epoch, "version": rec.version,
                       "ended": None if e is None else {"node": e.node, "rc": e.rc, "time": e.time},
                       "fatal": None if f is None else {"node": f.node, "code": f.code, "message": f.message},
                       "rdzv": rec.rdzv, "failed": failed_versions}, separators=(",", ":"))


def encode_owners(rec: JobRecord, owners_versions: list[int]) -> str:
    return json.dumps({"format": OWNERS_FORMAT, "epoch": rec.epoch, "version": rec.version,
                       "complete": rec.complete(), "parts": owners_versions}, separators=(",", ":"))


def largest_part_bytes(nodes: int) -> int:
    """The size in bytes of the largest part a job of ``nodes`` nodes can store: every node of its last
    part (the longest node numbers) present, with the widest pids (2^22) and verdict times."""
    last = parts_of(nodes) - 1
    rec = JobRecord(nodes=nodes, epoch="16383/4194304/1712345678.123456")
    for n in range(last * PART_NODES, min(nodes, (last + 1) * PART_NODES)):
        rec.owners[n] = Owners(4194304, 4194304, True)
        rec.failed[n] = Failed(4194304, 1712345678.1234567)
    return max(len(encode_part(rec, k, last, 1 << 40).encode()) for k in ("owners", "failed"))


# ---------------------------------------------------------------------------------------------- the root's side

class RecordKeeper:
    """The record at one store server (the embedded store's root), fed by
    :meth:`~megatron_ft.health.wire_store.KVServer.derive` under the map's lock: :meth:`install` it on a
    server; each derived call folds one key and returns the record's keys that changed (full keys). A
    heartbeat that changes no owner costs one JSON parse and returns nothing. ``epoch``: this server's
    (its node, pid and start)."""

    def __init__(self, nodes: int, epoch: str):
        self.rec = JobRecord(nodes=nodes, epoch=epoch)
        self.versions = {"owners": [0] * parts_of(nodes), "failed": [0] * parts_of(nodes)}
        self.prefix = ""

    def install(self, server, prefix: str) -> "RecordKeeper":
        """Derive the record on ``server`` (a :class:`~megatron_ft.health.wire_store.KVServer`) from the keys
        under ``prefix`` (the job's)."""
        self.prefix = prefix
        for source in SOURCES:
            server.derive(prefix + source, lambda k, v, s=source: self.fold(s + k, v), deletes=True)
        return self

    def fold(self, key: str, value: Optional[str]) -> dict[str, Optional[str]]:
        changed = apply(self.rec, key, value)
        if not changed:
            return {}
        out: dict[str, Optional[str]] = {}
        v = self.rec.version
        for kind, p in changed:
            if kind != "events":
                self.versions[kind][p] = v
                out[self.prefix + part_key(kind, p)] = encode_part(self.rec, kind, p, v)
        if ("events", 0) in changed or any(k == "failed" for k, _ in changed):
            out[self.prefix + EVENTS_KEY] = encode_events(self.rec, self.versions["failed"])
        if any(k == "owners" for k, _ in changed):
            out[self.prefix + OWNERS_KEY] = encode_owners(self.rec, self.versions["owners"])
        return out


# ---------------------------------------------------------------------------------------------- readers

class JobView:
    """A reader's copy of the record from a store with the embedded store's interface (``get`` and
    ``watch``: :class:`~.store.EmbeddedStore`, :class:`~.store.StoreClient`, a
    :class:`~.wire_store.WireKV`). Not thread-safe: one caller (a launcher's loop, a standby's wait, an
    agent's launcher watch). :attr:`version` counts the changes this view has seen (a root's new epoch
    is one), the token :meth:`wait` takes.

    Requests: :meth:`wait` one long poll per change (or per ``wait_s``) plus the failed parts that
    changed; :meth:`refresh` one read of ``job/events`` (with ``owners``: and of ``job/owners``) plus the
    parts that changed. None grows with N but the first read of the owners (ceil(N / 512) parts)."""

    def __init__(self, store, nodes: int):
        self.store, self.nodes = store, nodes
        self.record = JobRecord(nodes=nodes)
        self.version = 0
        self._raw: dict[str, Optional[str]] = {EVENTS_KEY: None, OWNERS_KEY: None}
        self._have: dict[str, list[Optional[int]]] = {"owners": [None] * parts_of(nodes),
                                                       "failed": [None] * parts_of(nodes)}

    def refresh(self, owners: bool = False) -> JobRecord:
        """The record now (``owners``: its owners too, else as last read)."""
        self._events(self.store.get(EVENTS_KEY))
        if owners:
            self._owners(self.store.get(OWNERS_KEY))
        return self.record

    def wait(self, after: int, wait_s: float) -> JobRecord:
        """The record once this view's :attr:`version` is past ``after`` - a change of the events
        (verdicts, fatal records, the end, the rendezvous) - or after ``wait_s`` (a long poll on
        ``job/events``: no request until it changes or the wait ends)."""
        if self.version != after:
            return self.record
        self._events(self.store.watch(EVENTS_KEY, self._raw[EVENTS_KEY], wait_s))
        return self.record

    def complete(self) -> int:
        """How many nodes have an agent and a launcher now: one read of ``job/owners`` (no part)."""
        return _complete_in(self.store.get(OWNERS_KEY))

    def wait_complete(self, nodes: int, within_s: float) -> int:
        """:meth:`complete` once it reaches ``nodes``, or after ``within_s``: a long poll on ``job/owners``,
        woken by its change (a new node's agent or launcher), not a read per period."""
        deadline = Deadline(within_s, "every node's agent and launcher")
        raw = self.store.get(OWNERS_KEY)
        while True:
            n = _complete_in(raw)
            if n >= nodes or deadline.expired():
                return n
            raw = self.store.watch(OWNERS_KEY, raw, min(1.0, deadline.left()))

    def close(self) -> None:
        """Nothing to end (no thread: every read is the caller's)."""

    def _new_epoch(self, epoch: str) -> None:
        if epoch != self.record.epoch:
            self.record = JobRecord(nodes=self.nodes, epoch=epoch)
            self._have = {k: [None] * parts_of(self.nodes) for k in self._have}
            self._raw[OWNERS_KEY] = None
            self.version += 1

    def _index(self, key: str, raw: Optional[str], fmt: str, kind: str) -> Optional[dict]:
        """The index ``raw`` of ``key`` parsed, or None when it has nothing new to read (unchanged, and
        no part of it left unread)."""
        if raw == self._raw[key] and None not in self._have[kind]:
            return None
        self._raw[key] = raw
        idx = _json(raw) if raw is not None else None
        if idx is None:  # a root that holds none of it yet (a new one, or nothing happened): empty
            r = self.record
            if kind == "owners":
                r.owners.clear()
            else:
                r.failed.clear()
                r.fatal, r.ended, r.rdzv = {}, None, None
            self._have[kind] = [0] * parts_of(self.nodes)
            self.version += 1
            return None
        if idx.get("format") != fmt:
            raise StoreUnavailable(f"{key} is not a {fmt} record: {raw[:120]!r}")
        self._new_epoch(str(idx.get("epoch", "")))
        return idx

    def _events(self, raw: Optional[str]) -> None:
        idx = self._index(EVENTS_KEY, raw, FORMAT, "failed")
        if idx is None:
            return
        r = self.record
        e, f = idx.get("ended"), idx.get("fatal")
        r.ended = Ended(int(e["node"]), e.get("rc"), float(e["time"])) if e else None
        r.fatal = {int(f["node"]): Fatal(int(f["node"]), int(f["code"]), str(f["message"]))} if f else {}
        r.rdzv = idx.get("rdzv")
        self._parts("failed", idx.get("failed", []), r.failed)
        self.version += 1

    def _owners(self, raw: Optional[str]) -> None:
        idx = self._index(OWNERS_KEY, raw, OWNERS_FORMAT, "owners")
        if idx is not None:
            self._parts("owners", idx.get("parts", []), self.record.owners)
            self.version += 1

    def _parts(self, kind: str, versions: list, into: dict) -> None:
        have = self._have[kind]
        for p, v in enumerate(versions[:len(have)]):
            if have[p] == v:
                continue
            lo, hi = p * PART_NODES, min(self.nodes, (p + 1) * PART_NODES)
            for n in [n for n in into if lo <= n < hi]:
                del into[n]
            text = self.store.get(part_key(kind, p)) if v else None  # version 0: never written, empty
            if text is None:
                have[p] = None if v else 0  # a part gone: the root moved meanwhile, read it again
                continue
            try:
                epoch, version, entries = decode_part(text, kind, p, self.nodes)
            except (ValueError, KeyError, TypeError, IndexError) as e:
                raise StoreUnavailable(str(e)) from None
            into.update(entries)
            have[p] = version if epoch == self.record.epoch else None


def wait_until(view, pred, wait_s: float, what: str):
    """``pred(record)`` once true (its value), waking on the view's changes, at most ``wait_s``: a
    :class:`TimeoutError` naming ``what`` after that."""
    deadline = time.monotonic() + wait_s
    rec = view.refresh()
    while True:
        got = pred(rec)
        if got:
            return got
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: not within {wait_s:g} s")
        rec = view.wait(view.version, left)

