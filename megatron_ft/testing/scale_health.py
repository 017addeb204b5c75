"""The scale bed's health, launch and spares scenarios (:mod:`.scale_bed` hosts the agents): what the
coordination store serves per node and per period, how long a heartbeat round takes at the root, how
soon a lost node is judged, and what the launcher side (each node's launcher, a standby) and the
keeper side (the warm spares' verdict watch) ask of the store - counted, against N.

Three parts:

* :class:`WorkerHealth`, in each worker of :class:`~.scale_bed.ScaleBed` (``mode="health"``: every
  agent's store, heartbeats and verdicts, no agreement, no trainers; the coordinator process stands
  as every node's launcher: each agent follows its pid, so heartbeats name a launcher as in a job).
  It times every agent's heartbeat (the monitor's ``beat`` wrapped on the instance, the agent's code
  untouched: on the root a beat is also its round over the others' heartbeats), counts the etcd
  client's requests (every ``EtcdKV`` made in the worker), and on command stops a node's agent as a
  lost one (its heartbeat thread stopped and its store closed: the embedded store's server stops
  listening, so its port refuses; on etcd its lease is no longer kept alive and lapses) and waits for
  the root's ``failed/<node>``.
* :class:`Sides`, one more process (``python -m megatron_ft.testing.scale_health``): the launcher side
  and the keeper side on the job's real store - a real ``Rendezvous`` per simulated node calling what
  a launcher calls per generation (``current``, ``begin``, ``keep_published`` while torchrun runs,
  ``after_failure``), standbys in ``claim_failed_node``, and the keepers' verdict watch (the per-rank
  ``VerdictWatch`` of before, or the per-node ``node_watch.VerdictStream``). Every request it sends is
  counted where it leaves (the store clients' request method wrapped at class level in that process,
  which sends nothing else), by op and key family, and every connection it opens.
* the coordinator's runs (:func:`health_run`, :func:`detect`, :func:`launch_run`,
  :func:`keepers_run`) and a real etcd server for ``--store etcd`` (:func:`start_etcd`; its own
  request counts from its metrics, beside the clients').

Only bounded waits: every command answers within its ``timeout_s``; the coordinator's ``recv`` bounds
each.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Optional


def _family(key: str) -> str:
    """``mft/<run>/hb/3`` -> ``hb`` (the op counts' key family, as ``KVServer.op_counts`` names it)."""
    return key.split("/")[2] if key.count("/") >= 2 else key


def _cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _etcd_registry() -> list:
    """Every ``EtcdKV`` made in this process from now on (their ``requests`` summed: the etcd client's
    own count of unary calls and watch streams opened)."""
    from ..health import etcd

    made: list = []
    inner = etcd.EtcdKV.__init__

    def init(self, *a, **kw):
        inner(self, *a, **kw)
        made.append(self)

    etcd.EtcdKV.__init__ = init
    return made


# ---------------------------------------------------------------------------------------- in each worker
class WorkerHealth:
    """A worker's health instruments and commands (see the module)."""

    def __init__(self, worker):
        self.w = worker
        self.lock = threading.Lock()
        self.recording = False
        self.root_beats: list[float] = []  # seconds, the root's beats while recording
        self.beats: collections.Counter = collections.Counter()  # other agents' beats: 0.1 ms bins -> count
        self.etcd_kvs = _etcd_registry() if worker.cfg.health.store.startswith("etcd://") else []
        self.killed: dict[int, float] = {}

    def instrument(self, agent) -> None:
        mon = agent.monitor
        if mon is None:
            return
        inner = mon.beat

        def beat(inner=inner, agent=agent):
            t0 = time.monotonic()
            try:
                inner()
            finally:
                if self.recording:
                    d = time.monotonic() - t0
                    root = agent.store is not None and agent.store.is_root
                    with self.lock:
                        if root:
                            self.root_beats.append(d)
                        else:
                            self.beats[int(d * 1e4)] += 1

        mon.beat = beat

    def _root(self):
        return next((a for a in self.w.agents if a.node not in self.killed and a.store is not None
                     and a.store.is_root), None)

    def _state(self) -> dict:
        root = self._root()
        out = {"ops": self.w._root_ops(), "etcd_requests": sum(kv.requests for kv in self.etcd_kvs),
               "cpu_s": _cpu_s(), "threads": threading.active_count(), "root_here": root is not None,
               "root_verdicts": None, "last_verdict": None}
        if root is not None:
            out["root_verdicts"] = sorted(int(n) for n in getattr(root.monitor, "failed", {}) or {})
            try:
                out["last_verdict"] = root.store.get("last_verdict")
            except Exception as e:  # noqa: BLE001 - reported, not raised
                out["last_verdict"] = f"unreadable: {e}"
        return out

    def command(self, cmd: dict) -> dict:
        op = cmd["cmd"]
        if op == "hb_window":
            if cmd["start"]:
                with self.lock:
                    self.root_beats, self.beats = [], collections.Counter()
                self.recording = True
                return {"event": op, **self._state()}
            self.recording = False
            with self.lock:
                beats, root = dict(self.beats), list(self.root_beats)
            return {"event": op, **self._state(), "root_beats": root, "beats": beats}
        if op == "kill":  # this node's agent is lost: no heartbeat from now, its store gone
            a = next(a for a in self.w.agents if a.node == cmd["node"])
            t = time.monotonic()
            a.monitor.stop()
            self.killed[a.node] = t
            a.store.close()
            return {"event": op, "node": a.node, "t": t, "closed_s": time.monotonic() - t}
        if op == "await_keys":  # the root's store, read by the root's agent every 20 ms, until every key is there
            root = self._root()
            deadline = time.monotonic() + cmd["timeout_s"]
            seen: dict[str, tuple[float, str]] = {}
            while root is not None and len(seen) < len(cmd["keys"]) and time.monotonic() < deadline:
                for key in cmd["keys"]:
                    if key in seen:
                        continue
                    try:
                        value = root.store.get(key)
                    except Exception:  # noqa: BLE001 - asked again
                        value = None
                    if value is not None:
                        seen[key] = (time.monotonic(), value)
                time.sleep(0.02)
            return {"event": op, "seen": seen, "root_here": root is not None}
        if op == "adopt":  # a restarted launcher of this node took its agent over (its pid in the next beat)
            a = next(a for a in self.w.agents if a.node == cmd["node"])
            a.launcher.adopt(int(cmd["pid"]))
            return {"event": op}
        if op == "state":
            return {"event": op, **self._state()}
        if op == "quiesce":  # the bed's teardown: every heartbeat stopped before any agent stops
            self.recording = False
            for a in self.w.agents:
                if a.monitor is not None:
                    a.monitor.stop()
            return {"event": op}
        return {"event": "error", "error": f"unknown command {op!r}"}


# ---------------------------------------------------------------------------------------- the launcher and keeper side
class _Counted:
    """Counts every request the store clients of this process send (class-level wrappers: the embedded
    store's ``WireKV._request`` by op and key family, connections opened; etcd's ``EtcdKV`` requests)."""

    def __init__(self):
        from ..health import wire_store

        self.ops: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        req, init = wire_store.WireKV._request, wire_store.WireKV.__init__
        me = self

        def _request(self, op: str, **fields):
            fam = _family(fields.get("key", ""))
            with me.lock:
                me.ops[op] += 1
                me.ops[f"{op} {fam}"] += 1
            return req(self, op, **fields)

        def __init__(self, *a, **kw):
            with me.lock:
                me.ops["connect"] += 1
            init(self, *a, **kw)

        wire_store.WireKV._request, wire_store.WireKV.__init__ = _request, __init__
        self.etcd = _etcd_registry()

    def snapshot(self) -> dict:
        with self.lock:
            out = dict(self.ops)
        out["etcd requests"] = sum(kv.requests for kv in self.etcd)
        return out


def _requests(ops: dict) -> int:
    """Requests in an op count (``connect`` apart: a connection is no request)."""
    return sum(v for k, v in ops.items() if " " not in k and k != "connect") + ops.get("etcd requests", 0)


def _delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)}


class Sides:
    """The launcher side and the keeper side of the job (see the module)."""

    def __init__(self, cfg, config_path: str):
        self.cfg, self.config_path = cfg, config_path
        self.count = _Counted()
        self.launchers: dict[int, object] = {}
        self.logs: collections.Counter = collections.Counter()

    def _launch(self):
        from .. import launch

        return launch

    def _phase(self, nodes: list[int], fn, threads: int) -> dict:
        c0, t0 = self.count.snapshot(), time.monotonic()
        errors: list[str] = []
        results: list = []

        def one(n: int):
            try:
                return fn(n)
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(f"node {n}: {type(e).__name__}: {str(e)[:200]}")
                return None

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="side") as pool:
            results = list(pool.map(one, nodes))
        wall = time.monotonic() - t0
        ops = _delta(c0, self.count.snapshot())
        return {"nodes": len(nodes), "ops": ops, "requests": _requests(ops), "wall_s": wall, "errors": errors[:10],
                "failed": len(errors), "results": collections.Counter(json.dumps(r) for r in results).most_common(5)}

    def rendezvous(self, n: int, fresh: bool = False):
        if fresh or n not in self.launchers:
            self.launchers[n] = self._launch().Rendezvous(self.cfg, n)
        return self.launchers[n]

    def launch_phase(self, phase: str, nodes: list[int], threads: int, gen: Optional[dict]) -> dict:
        launch = self._launch()
        cur = launch.RdzvGeneration(**gen) if gen else None

        def log(msg: str) -> None:
            self.logs[msg.split("]", 1)[-1][:60]] += 1

        def fn(n: int):
            r = self.rendezvous(n, fresh=phase == "restart")
            if phase in ("current", "restart"):
                g = r.current(log)
                return [g.gen, g.node]
            if phase == "begin":
                r.begin(cur)
                return "ok"
            if phase == "keep_published":
                r.keep_published(cur)
                return "ok"
            if phase == "after_failure":
                g = r.after_failure(cur, log)
                return [g.gen, g.node] if g is not None else None
            raise ValueError(f"phase {phase!r}")

        return self._phase(nodes, fn, threads)

    def published(self) -> Optional[dict]:
        """The ``rdzv`` record now (read on a client of its own, not counted in a phase)."""
        from ..health.store import StoreClient

        c = StoreClient(self.cfg)
        try:
            raw = c.get("rdzv")
        finally:
            kv = getattr(c, "kv", None)
            if kv is not None:
                kv.close()
        rec = json.loads(raw) if raw else None
        if rec is None:
            return None
        return {k: rec[k] for k in ("gen", "node", "addr", "port", "host_agent", "host_launcher") if k in rec}

    def standby(self, count: int, span_s: float, poll_s: float) -> dict:
        """``count`` standbys in ``claim_failed_node`` for ``span_s`` (each its own store client, as a
        standby launcher has): answered at the first claim (the others wait on, to their span's end), or
        at the span's end with none. The requests: all of them until the answer."""
        from ..health.store import StoreClient

        launch = self._launch()
        t0, c0, w0 = time.time(), self.count.snapshot(), time.monotonic()
        done: "queue.Queue[dict]" = queue.Queue()

        def one(i: int) -> None:
            client = StoreClient(self.cfg)
            try:
                node, verdict = launch.claim_failed_node(client, self.cfg.cluster.nodes, f"bed:standby{i}",
                                                         poll_s=poll_s, timeout_s=span_s, log=lambda m: None,
                                                         since=t0 - self.cfg.health.timeout_s)
                done.put({"node": node, "pid": verdict.get("pid"), "t": time.monotonic()})
            except TimeoutError:
                done.put({"node": None, "t": time.monotonic()})
            except Exception as e:  # noqa: BLE001 - reported
                done.put({"node": None, "error": f"{type(e).__name__}: {str(e)[:200]}", "t": time.monotonic()})
            finally:
                kv = getattr(client, "kv", None)
                if kv is not None:
                    kv.close()

        for i in range(count):
            threading.Thread(target=one, args=(i,), name=f"standby{i}", daemon=True).start()
        claims: list[dict] = []
        while len(claims) < count:
            try:
                c = done.get(timeout=max(0.1, w0 + span_s + 60 - time.monotonic()))
            except queue.Empty:
                break
            claims.append(c)
            if c.get("node") is not None:
                break
        ops = _delta(c0, self.count.snapshot())
        return {"claims": claims, "ops": ops, "requests": _requests(ops), "wall_s": time.monotonic() - w0,
                "errors": [c["error"] for c in claims if c.get("error")]}

    def keepers(self, kind: str, nodes: int, per_node: int, window_s: float) -> dict:
        """The keepers' watch of the root's verdicts during one fast restart round's settling window
        (``health.timeout_s + 1`` s from the round's start), on ``nodes`` nodes of ``per_node`` ranks:
        ``before``: each keeper's own ``VerdictWatch``, read every ``keeper.VERDICT_POLL_S``; ``after``:
        one ``node_watch.VerdictStream`` per node, its window opened by each of its keepers."""
        if kind == "before":
            from ..spares import fast_restart as fr
            from ..spares import keeper

            env = {"MFT_CONFIG": self.config_path}
            since = time.time()
            poll = keeper.VERDICT_POLL_S

            def fn(i: int):
                w = fr.VerdictWatch(env, since)
                end, asked, lost = time.monotonic() + window_s, 0, 0
                while time.monotonic() < end:
                    lost += bool(w.node_lost())
                    asked += 1
                    time.sleep(poll)
                if w.client is not None and getattr(w.client, "kv", None) is not None:
                    w.client.kv.close()
                return asked

            out = self._phase(list(range(nodes * per_node)), fn, nodes * per_node)
            out["poll_s"] = poll
        else:
            from ..spares import node_watch

            got: list = []

            def fn(i: int):
                s = node_watch.VerdictStream(self.config_path, lambda stream, msg: got.append(msg))
                for _ in range(per_node):  # each keeper's round start opens (extends) the window
                    s.extend(window_s)
                time.sleep(window_s + 0.5)
                s.stop()
                return dict(s.counts)

            out = self._phase(list(range(nodes)), fn, nodes)
            out["verdicts_told"] = len(got)
        out.update(kind=kind, nodes=nodes, keepers=nodes * per_node, per_node=per_node, window_s=window_s)
        return out

    def idle(self, span_s: float) -> dict:
        """Nothing called for ``span_s``: what the launchers' own threads send meanwhile (on etcd the job
        record's watch stream of each launcher, re-opened every ``job_view_etcd.WATCH_S``)."""
        c0, t0 = self.count.snapshot(), time.monotonic()
        time.sleep(span_s)
        ops = _delta(c0, self.count.snapshot())
        return {"ops": ops, "requests": _requests(ops), "wall_s": time.monotonic() - t0}

    def close(self) -> None:
        for r in self.launchers.values():
            kv = getattr(getattr(r, "store", None), "kv", None)
            if kv is not None:
                with contextlib.suppress(Exception):
                    kv.close()


def _sides_main() -> None:
    from .. import config as ftconfig
    from .scale_procs import _raise_nofile

    spec = json.loads(sys.stdin.readline())
    _raise_nofile()
    threading.stack_size(512 << 10)
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="[scale-sides %(asctime)s] %(name)s %(levelname)s %(message)s")
    cfg = ftconfig.from_dict(spec["config"], source="<scale bed>")
    s = Sides(cfg, spec["config_path"])

    def say(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    say({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        try:
            if op == "launch":
                say({"event": op, **s.launch_phase(cmd["phase"], cmd["nodes"], cmd.get("threads", 8), cmd.get("gen"))})
            elif op == "published":
                say({"event": op, "gen": s.published()})
            elif op == "idle":
                say({"event": op, **s.idle(cmd["span_s"])})
            elif op == "standby":
                say({"event": op, **s.standby(cmd["count"], cmd["span_s"], cmd.get("poll_s", 0.2))})
            elif op == "keepers":
                say({"event": op, **s.keepers(cmd["kind"], cmd["nodes"], cmd["per_node"], cmd["window_s"])})
            elif op == "stop":
                break
        except Exception as e:  # noqa: BLE001 - said
            say({"event": "error", "error": f"{type(e).__name__}: {e}"})
    s.close()
    say({"event": "stopped"})
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------- the coordinator
def start_sides(bed) -> object:
    """The launcher/keeper side's process for ``bed`` (a started :class:`~.scale_bed.ScaleBed`)."""
    from .scale_procs import _Proc

    log_path = os.path.join(bed.tmp, "sides.log")
    with open(log_path, "w") as log:
        popen = subprocess.Popen([sys.executable, "-m", "megatron_ft.testing.scale_health"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=log, text=True)
    p = _Proc(popen, -1, -1, log_path)
    p.send({"config": bed.config, "config_path": bed.config_path})
    p.pid = p.recv(120, "ready")["pid"]
    return p


def stop_sides(p) -> None:
    with contextlib.suppress(Exception):
        if p.popen.poll() is None:
            p.send({"cmd": "stop"})
            p.recv(60, "stopped")
    try:
        p.popen.wait(30)
    except subprocess.TimeoutExpired:
        p.popen.kill()  # only the bed's own process, by its pid
        p.popen.wait(10)


def _hist_pct(hist: dict, q: float) -> Optional[float]:
    """The ``q`` quantile (seconds) of a histogram of 0.1 ms bins."""
    total = sum(hist.values())
    if not total:
        return None
    k, seen = q * (total - 1), 0
    for b in sorted(hist, key=int):
        seen += hist[b]
        if seen > k:
            return int(b) / 1e4
    return int(max(hist, key=int)) / 1e4


def _pct(xs: list[float], q: float) -> Optional[float]:
    xs = sorted(xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def health_run(bed, span_s: float, etcd=None) -> dict:
    """``span_s`` of N healthy nodes heartbeating: the store's requests per node per heartbeat period
    (embedded: the root server's op counts; etcd: the agents' clients and the server's own count), the
    heartbeat rounds (p50/p99 at the root, and every other agent's beat), false verdicts."""
    n, hb = bed.nodes, bed.heartbeat_s
    s0 = bed.ask_all({"cmd": "hb_window", "start": True})
    e0 = etcd.requests() if etcd is not None else None
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    time.sleep(span_s)
    s1 = bed.ask_all({"cmd": "hb_window", "start": False})
    window = time.monotonic() - t0
    e1 = etcd.requests() if etcd is not None else None
    periods = window / hb
    root0 = next((r for r in s0 if r["root_here"]), {})
    root1 = next((r for r in s1 if r["root_here"]), {})
    ops = _delta(root0.get("ops") or {}, root1.get("ops") or {})
    reqs = _requests(ops) if ops else None
    etcd_client = sum(r["etcd_requests"] for r in s1) - sum(r["etcd_requests"] for r in s0)
    hist: collections.Counter = collections.Counter()
    for r in s1:
        hist.update({int(k): v for k, v in r["beats"].items()})
    root_beats = [b for r in s1 for b in r["root_beats"]]
    out = {
        "nodes": n, "procs": len(bed.workers), "store": "etcd" if etcd is not None else "embedded",
        "heartbeat_s": hb, "timeout_s": bed.timeout_s, "span_s": round(window, 1), "periods": round(periods, 1),
        "root_ops": ops,
        "store_requests_per_node_period": (reqs / (n * periods)) if reqs is not None else None,
        "store_requests_per_s": (reqs / window) if reqs is not None else None,
        "etcd_client_requests_per_node_s": etcd_client / (n * window) if etcd is not None else None,
        "etcd_client_requests_per_node_period": etcd_client / (n * periods) if etcd is not None else None,
        "etcd_server_requests_per_node_s": ((e1 - e0) / (n * window)) if etcd is not None and e0 is not None
        and e1 is not None else None,
        "root_round_p50_ms": 1e3 * statistics.median(root_beats) if root_beats else None,
        "root_round_p99_ms": 1e3 * _pct(root_beats, 0.99) if root_beats else None,
        "root_round_max_ms": 1e3 * max(root_beats) if root_beats else None, "root_rounds": len(root_beats),
        "beat_p50_ms": 1e3 * (_hist_pct(hist, 0.5) or 0), "beat_p99_ms": 1e3 * (_hist_pct(hist, 0.99) or 0),
        "beats": sum(hist.values()),
        "false_verdicts": len(root1.get("root_verdicts") or []), "last_verdict": root1.get("last_verdict"),
        "bed_cpu_cores": (sum(r["cpu_s"] for r in s1) - sum(r["cpu_s"] for r in s0)) / window,
        # the root's worker (with root_alone: the root's agent and store alone): its CPU per request served
        "root_worker_cpu_cores": (s1[0]["cpu_s"] - s0[0]["cpu_s"]) / window,
        "root_worker_us_per_request": (1e6 * (s1[0]["cpu_s"] - s0[0]["cpu_s"]) / reqs) if reqs else None,
        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "threads": sum(r["threads"] for r in s1), **bed.started,
    }
    return out


def detect(bed, victims: list[int], sides=None, standbys: int = 0) -> dict:
    """The agents of ``victims`` lost at once (:meth:`WorkerHealth.command` ``kill``, one after the other):
    for each, the time from its loss to the root's ``failed/<node>``; and (``standbys``) until the first of
    that many waiting standbys claimed one of them."""
    if standbys and sides is not None:
        sides.send({"cmd": "standby", "count": standbys, "span_s": 4 * bed.timeout_s + 30, "poll_s": 0.2})
        time.sleep(0.5)  # the standbys asked once at least
    root_w = bed.workers[0]
    root_w.send({"cmd": "await_keys", "keys": [f"failed/{v}" for v in victims], "timeout_s": 3 * bed.timeout_s + 30})
    load0 = os.getloadavg()[0]
    killed = {v: bed.ask(v, {"cmd": "kill", "node": v}) for v in victims}
    seen = root_w.recv(3 * bed.timeout_s + 60, "await_keys")["seen"]
    times, verdicts = [], []
    for v in victims:
        got = seen.get(f"failed/{v}")
        times.append((got[0] - killed[v]["t"]) if got else None)
        if got:
            rec = json.loads(got[1])
            verdicts.append({k: rec.get(k) for k in ("node", "pid", "detected_by", "why")})
    found = [t for t in times if t is not None]
    out = {"nodes": bed.nodes, "victims": victims, "timeout_s": bed.timeout_s, "heartbeat_s": bed.heartbeat_s,
           "detected": times, "detected_s": max(found) if len(found) == len(victims) else None,
           "detected_min_s": min(found) if found else None, "verdicts": verdicts,
           "store_closed_s": max(k["closed_s"] for k in killed.values()),
           "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    if standbys and sides is not None:
        st = sides.recv(4 * bed.timeout_s + 90, "standby")
        claims = [c for c in st["claims"] if c.get("node") is not None]
        out["claims"] = len(claims)
        out["claimed_s"] = (min(c["t"] for c in claims) - min(k["t"] for k in killed.values())) if claims else None
        out["claimed_node"] = claims[0]["node"] if claims else None
        out["standby_ops"] = st["ops"]
        out["standby_errors"] = st["errors"]
    return out


def launch_run(bed, sides, threads: int = 8, standby_span_s: float = 10.0, standbys: int = 2) -> dict:
    """The launcher side's requests at the store (:class:`Sides`): every node's launcher's start
    (``current``, ``begin`` of generation 0: node 0 first, the host), one ``keep_published`` each (its
    cost per 2 s while torchrun runs), then a new generation: node 0's launcher restarted (its agent
    adopted by another pid, so its heartbeat names another launcher: generation 0's host is gone as a
    host), every survivor's ``after_failure`` (node 1, the lowest survivor, first: it hosts generation
    1; the others find it published), node 0's new launcher's ``current``, every node's ``begin`` of
    generation 1; and ``standbys`` standbys waiting ``standby_span_s`` with no failure (their cost per
    period). Requests counted where they leave the side process."""
    n = bed.nodes
    everyone, others = list(range(n)), list(range(1, n))

    def phase(name: str, nodes: list[int], gen: Optional[dict] = None, th: int = threads) -> dict:
        r = sides_ask(sides, {"cmd": "launch", "phase": name, "nodes": nodes, "threads": th, "gen": gen},
                      timeout_s=600 + 2 * len(nodes))
        if r["failed"]:
            raise RuntimeError(f"launch phase {name}: {r['failed']} failed: {r['errors'][:3]}")
        return r

    from .. import config as ftconfig

    cfg = ftconfig.from_dict(bed.config, source="<scale bed>")
    gen0 = {"gen": 0, "node": 0, "addr": cfg.launch.master_addr, "port": cfg.launch.rdzv_port}  # Rendezvous.initial
    load0, t0 = os.getloadavg()[0], time.monotonic()
    start = phase("current", everyone)
    if [r for r, _ in start["results"]] != ["[0, 0]"]:
        raise RuntimeError(f"the launchers' start joined {start['results']}, not generation 0 on node 0")
    begin_host = phase("begin", [0], gen0, 1)
    begin_rest = phase("begin", others, gen0)
    keep = phase("keep_published", everyone, sides_ask(sides, {"cmd": "published"})["gen"] or gen0)
    # the launchers' own threads while torchrun runs (etcd: each one's job record stream), then the standbys
    # waiting meanwhile: their own requests are the difference
    idle = sides_ask(sides, {"cmd": "idle", "span_s": standby_span_s}, timeout_s=standby_span_s + 60)
    standby = sides_ask(sides, {"cmd": "standby", "count": standbys, "span_s": standby_span_s, "poll_s": 0.2},
                        timeout_s=standby_span_s + 120)
    standby_own = standby["requests"] - idle["requests"] * standby["wall_s"] / idle["wall_s"]
    # node 0's launcher restarted: its agent names another launcher from its next heartbeat
    bed.ask(0, {"cmd": "adopt", "node": 0, "pid": sides.pid})
    time.sleep(2 * bed.heartbeat_s + 0.5)
    published = sides_ask(sides, {"cmd": "published"})["gen"] or gen0
    fail_host = phase("after_failure", [1], published, 1)
    fail_rest = phase("after_failure", others[1:], published) if n > 2 else None
    gen1 = sides_ask(sides, {"cmd": "published"})["gen"]
    restart = phase("restart", [0], None, 1)
    begin1 = phase("begin", everyone, gen1)
    per_gen = [fail_host, fail_rest, restart, begin1]
    gen_requests = sum(p["requests"] for p in per_gen if p)
    return {
        "nodes": n, "generation_1": gen1,
        "start_requests_per_launcher": (start["requests"] + begin_host["requests"] + begin_rest["requests"]) / n,
        "current_per_launcher": start["requests"] / n, "begin_per_launcher": (begin_host["requests"] +
                                                                            begin_rest["requests"]) / n,
        "keep_published_per_launcher": keep["requests"] / n,
        "generation_requests_per_launcher": gen_requests / n,
        "after_failure_host_requests": fail_host["requests"],
        "after_failure_other_per_launcher": (fail_rest["requests"] / len(others[1:])) if fail_rest else None,
        "begin_next_per_launcher": begin1["requests"] / n,
        "connections_per_launcher": sum(p["ops"].get("connect", 0) for p in [start, begin_host, begin_rest] + per_gen
                                        if p) / n,
        "launcher_idle_requests_per_s": idle["requests"] / (n * idle["wall_s"]),
        "standby_requests_per_s": standby_own / (standbys * standby["wall_s"]),
        "standby_requests_per_period": standby_own / (standbys * standby["wall_s"] / bed.heartbeat_s),
        "standby_claims": [c for c in standby["claims"] if c.get("node") is not None],
        "phases": {"current": start["ops"], "begin": begin_rest["ops"], "keep_published": keep["ops"],
                   "after_failure_host": fail_host["ops"], "after_failure_other": fail_rest["ops"] if fail_rest else {},
                   "begin_next": begin1["ops"], "standby": standby["ops"], "idle": idle["ops"]},
        "wall_s": round(time.monotonic() - t0, 1), "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


def keepers_run(bed, sides, kind: str, nodes: int, per_node: int) -> dict:
    """One fast restart round's verdict watch on ``nodes`` nodes of ``per_node`` keepers
    (:meth:`Sides.keepers`): requests per node per round."""
    window = bed.timeout_s + 1.0
    r = sides_ask(sides, {"cmd": "keepers", "kind": kind, "nodes": nodes, "per_node": per_node, "window_s": window},
                  timeout_s=window + 300)
    r["requests_per_node_round"] = r["requests"] / nodes
    r["requests_per_keeper_round"] = r["requests"] / (nodes * per_node)
    return r


def sides_ask(sides, cmd: dict, timeout_s: float = 600.0) -> dict:
    sides.send(cmd)
    return sides.recv(timeout_s, cmd["cmd"])


# ---------------------------------------------------------------------------------------- a real etcd
class Etcd:
    """A one-member etcd server on free loopback ports, its data in a tmpfs directory (``start_etcd``);
    :meth:`requests`: the requests it served (its ``grpc_server_handled_total``, every gRPC call the
    HTTP gateway made for the clients, watch streams included)."""

    def __init__(self, proc: subprocess.Popen, url: str, metrics: str, d: str):
        self.proc, self.url, self.metrics, self.dir = proc, url, metrics, d

    def requests(self) -> Optional[int]:
        try:
            text = urllib.request.urlopen(self.metrics, timeout=10).read().decode()
        except OSError:
            return None
        total = 0.0
        for line in text.splitlines():
            if line.startswith("grpc_server_started_total{"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_etcd(binary: Optional[str] = None, ready_s: float = 30.0) -> Etcd:
    """A one-member etcd (as ``tests/integration/test_health.py`` starts one), healthy, or RuntimeError."""
    from ..health.etcd import EtcdKV
    from ..health.kv import StoreUnavailable

    exe = binary or shutil.which("etcd")
    if exe is None:
        raise RuntimeError("no etcd binary on PATH (Debian: apt-get install etcd-server)")
    d = tempfile.mkdtemp(prefix="mftsb-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    client, peer = _free_port(), _free_port()
    log = open(os.path.join(d, "etcd.log"), "wb")
    proc = subprocess.Popen([exe, "--name", "bed", "--data-dir", os.path.join(d, "data"),
                             "--listen-client-urls", f"http://127.0.0.1:{client}",
                             "--advertise-client-urls", f"http://127.0.0.1:{client}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"bed=http://127.0.0.1:{peer}", "--metrics", "basic"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    url = f"etcd://127.0.0.1:{client}"
    e = Etcd(proc, url, f"http://127.0.0.1:{client}/metrics", d)
    try:
        EtcdKV(url, "probe/").wait_ready(ready_s)
    except StoreUnavailable:
        with open(os.path.join(d, "etcd.log"), errors="replace") as f:
            tail = f.read()[-2000:]
        e.stop()
        raise RuntimeError(f"etcd did not become healthy:\n{tail}") from None
    return e


if __name__ == "__main__":
    _sides_main()
