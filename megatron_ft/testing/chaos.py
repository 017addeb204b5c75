"""``megatron-ft chaos``: a seeded campaign of failures, each trial classified against the
promised recovery tiers (:mod:`megatron_ft.tiers`).

Every trial is one ``megatron-ft demo`` run (real launchers, agents, torchrun, gloo trainers,
SIGKILL) with a failure kind, a kill iteration and a wall-clock delay after it, all drawn from
``Random(seed * 1_000_003 + trial)``: the same seed and trial number give the same trial. A trial is

* **right** when the job ends bit-exact with every iteration's loss, at the promised tier or
  better, with exactly one hang verdict per victim in the hang kinds and none in any other, and
  leaves no ``/dev/shm`` segment, Unix socket or process of its run behind; for ``max-restarts-0`` when the
  job ends with a non-zero exit, cleanly; for the kinds without a failure (``slow-trainer``,
  ``agent-pause``) when the job trains through bit-exact with no restart and no verdict;
* **wrong** otherwise: ``hang`` (past ``--trial-timeout``), ``mismatch``, ``crash`` (no summary),
  ``lower-tier``, ``leak``.

Results go to a JSON-lines file, one line per trial with the machine's load average before and after;
a campaign resumes where it stopped (trials already in the file are skipped), so it can run in
batches. ``--docs`` writes the tally to ``docs/reliability.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import psutil
import yaml

from .. import config as ftconfig
from .. import tiers

#: kind -> demo arguments; the promised tier comes from megatron_ft.tiers
KINDS: dict[str, dict] = {
    "trainer": {"fail": "trainer"},
    "all-trainers": {"fail": "all-trainers"},
    "agent-then-trainer": {"fail": "trainer", "kill_agent": True},
    "launcher": {"fail": "launcher"},
    # node 0's torchrun hosts the rendezvous: the survivors agree on a new host through the store, which
    # the agents run whatever the scheme
    "launcher0": {"fail": "launcher", "redundancy": "replica", "victim_node": 0},
    "launcher0-none": {"fail": "launcher", "victim_node": 0},
    "launcher0-xor": {"fail": "launcher", "redundancy": "xor", "victim_node": 0},
    "launcher0-rs": {"fail": "launcher", "redundancy": "rs", "victim_node": 0},
    "node-replica": {"fail": "node", "redundancy": "replica"},
    "node0-replica": {"fail": "node", "redundancy": "replica", "victim_node": 0},  # hosts the rendezvous
    "node-xor": {"fail": "node", "redundancy": "xor"},
    "node-rs": {"fail": "node", "redundancy": "rs"},
    "corrupt": {"fail": "trainer", "kill_point": "corrupt-after-commit"},
    "truncated": {"fail": "trainer", "kill_point": "truncate-after-commit"},
    # the newest committed slot holds NaN and checksums that match it: restore's guard must refuse it
    "poisoned": {"fail": "trainer", "kill_point": "poison-after-commit", "rollbacks": 1},
    # Adam's first moments x 1e4, checksums recomputed: finite, verifies; the losses after the restore spike
    "scaled-optimizer": {"fail": "trainer", "kill_point": "scale-optimizer-after-commit", "rollbacks": 1},
    # the node's agent dies first, then the newest committed slot is cut: to zero bytes, inside its
    # header or inside its data; the restarted agent finds it so (the rank's older clean slot stays)
    "cut-empty+agent": {"fail": "trainer", "kill_point": "truncate-empty-after-commit", "with_agent": True},
    "cut-header+agent": {"fail": "trainer", "kill_point": "truncate-header-after-commit", "with_agent": True},
    "cut-data+agent": {"fail": "trainer", "kill_point": "truncate-after-commit", "with_agent": True},
    "mid-copy": {"fail": "all-trainers", "kill_point": "mid-copy"},
    "max-restarts-0": {"fail": "trainer", "max_restarts": 0},
    # the agent alone: its restart must protect the next steps (the node's trainers are killed after
    # it); a restart takes seconds, dozens of the demo's iterations, so the run is longer
    "agent": {"fail": "agent", "kill_at_max": 5, "iters": 48, "shape": "default-48"},
    # a second failure while the first recovery runs: the same tier as one
    "second-failure": {"fail": "trainer", "second_failure": True},
    "node-replica-second-failure": {"fail": "node", "redundancy": "replica", "second_failure": True},
    # two nodes of one group at once: within rs m=2's tolerance (any pair of the 4 nodes, drawn), and
    # beyond xor's (disk, at the newest step persisted whole: persisted every 3 steps here)
    "two-nodes-rs": {"fail": "two-nodes", "redundancy": "rs", "pairs_of": 4},
    "two-nodes-xor": {"fail": "two-nodes", "redundancy": "xor",
                      "train_args": ["--inmem-ckpt-persist-interval=3"], "shape": "xor-persist3"},
    # with the cluster file's own scheme (``--config``): a node, node 0, two nodes of one group
    "node": {"fail": "node", "config_only": True},
    "node0": {"fail": "node", "victim_node": 0, "config_only": True},
    # hangs: the agents' hang rule must name the victim (one verdict), SIGKILL it, and the job recover
    # from local memory. A trainer SIGSTOPped after an iteration, never resumed:
    "hang": {"fail": "hang", "hangs": 1},
    # a trainer SIGKILLed, whose restarted life then hangs inside its restore (the demo's job gets a
    # hang.restore_s of 15 s): its training thread sleeps for good (running: the restore allowance
    # elapses), or the process SIGSTOPs itself (seen stopped for hang.floor_s)
    "hang-in-restore": {"fail": "hang-in-restore", "hangs": 1},
    "stop-in-restore": {"fail": "hang-in-restore", "restore_hang": "stop", "hangs": 1},
    # no failure: a trainer stopped 0.3 s of every 0.6 s for the rest of the run (at most 15 s) is slow,
    # not hung - no verdict, no restart, bit-exact
    "slow-trainer": {"fail": "slow", "no_failure": True, "kill_at_max": 5, "iters": 48, "shape": "default-48"},
    # the last node's agent SIGSTOPped 8 s (> health.timeout_s, 5 s), then continued: either no verdict
    # and the job trains through, or the node judged lost and its ranks recovered - never a verdict
    # left standing on a node that trains on (docs/reliability.md, "A paused agent")
    "agent-pause": {"fail": "agent-pause", "pause": True},
    "two-nodes": {"fail": "two-nodes", "config_only": True},
    # mixture-of-experts shapes (demo --moe: 4 experts, top-2, the router's expert bias, the chained
    # optimizer; EP2 on 2 nodes x 2, EP4 on rs's 4 x 1: EDP 1); drawn only when --kinds names them
    "moe-trainer": {"fail": "trainer", "moe": True, "shape": "moe"},
    "moe-node-replica": {"fail": "node", "redundancy": "replica", "moe": True, "shape": "moe-replica"},
    "moe-node-rs": {"fail": "node", "redundancy": "rs", "moe": True, "shape": "moe-rs"},
    # NaN in an expert shard of the victim's newest committed slot (its expert parameter bucket slice),
    # checksums recomputed: only the guard can tell; every rank rolls back to the version before
    "moe-poisoned-expert": {"fail": "trainer", "kill_point": "poison-expert-after-commit", "rollbacks": 1,
                            "moe": True, "shape": "moe"},
    # a node lost (any of them, drawn) and no replacement: the job goes on at fewer data-parallel replicas from
    # memory, the node comes back and it grows again (demo --elastic: its own reference, Megatron's reshard)
    "elastic": {"fail": "node", "elastic": True, "redundancy": "replica", "iters": 40, "kill_at_max": 10,
                "victims_of": 3, "shape": "elastic-replica"},
    "elastic-xor": {"fail": "node", "elastic": True, "redundancy": "xor", "iters": 40, "kill_at_max": 10,
                    "victims_of": 3, "shape": "elastic-xor"},
    "elastic-rs": {"fail": "node", "elastic": True, "redundancy": "rs", "iters": 40, "kill_at_max": 10,
                   "victims_of": 4, "shape": "elastic-rs"},
}
#: kinds a campaign draws only when ``--kinds`` names them (each trial of theirs is longer)
OPT_IN_KINDS = tuple(k for k, v in KINDS.items() if v.get("moe") or v.get("elastic"))
#: the outcomes of a paused agent that are right (``megatron_ft.testing.demo.PAUSE_OUTCOMES``)
PAUSE_RIGHT = ("trained through", "node recovered")
#: the kinds a campaign on a cluster file (``--config``) draws from: no scheme, step count or
#: restart limit of their own, so the file's hold
CONFIG_KINDS = ("trainer", "all-trainers", "agent-then-trainer", "launcher", "launcher0", "node", "node0",
                "two-nodes", "corrupt", "truncated", "poisoned", "scaled-optimizer", "cut-empty+agent",
                "cut-header+agent", "cut-data+agent", "mid-copy", "second-failure")
#: node and two-node losses: half the trials strike after the first iteration, within the first second
#: (the first versions still being exchanged and completed)
EARLY_FAILS = ("node", "two-nodes")
EARLY_WINDOW_S = 1.0


@dataclass(frozen=True)
class Trial:
    index: int
    seed: int
    kind: str
    kill_at: int
    kill_delay: float  # seconds after the victims logged kill_at (after-iteration kinds)
    iters: int
    second_delay: float = 0.0  # seconds after the restarted trainer appeared (second-failure kinds)
    config: Optional[str] = None  # a cluster file (its shape and scheme) instead of the demo's shapes
    lost_pair: Optional[tuple[int, int]] = None  # two-node kinds that draw which two nodes are lost
    hosts: bool = False  # every node on a host of its own (the multi-host test bed)
    link_rate: Optional[str] = None  # hosts: every link's rate (tc tbf), e.g. "200mbit"
    victim: Optional[int] = None  # kinds that draw the lost node (elastic)

    def demo_args(self) -> list[str]:
        k = KINDS[self.kind]
        out = [f"--fail={k['fail']}", f"--kill-at={self.kill_at}", f"--iters={self.iters}"]
        if k.get("moe"):
            out.append("--moe")
        if k.get("elastic"):
            out.append("--elastic")
        if self.config:
            out.append(f"--config={self.config}")
        elif k.get("redundancy"):
            out.append(f"--redundancy={k['redundancy']}")
        if k.get("second_failure"):
            out += ["--second-failure", f"--second-delay={self.second_delay:.4f}"]
        out += [f"--train-arg={a}" for a in k.get("train_args", [])]
        if k.get("kill_point"):
            out.append(f"--kill-point={k['kill_point']}")
        else:
            out.append(f"--kill-delay={self.kill_delay:.4f}")
        if k.get("kill_agent"):
            out.append("--kill-agent")
        if k.get("restore_hang"):
            out.append(f"--restore-hang={k['restore_hang']}")
        if k.get("with_agent"):
            out.append("--with-agent")
        if self.hosts:
            out.append("--hosts")
            if self.link_rate:
                out.append(f"--link-rate={self.link_rate}")
        if self.lost_pair is not None:
            out += [f"--victim-node={self.lost_pair[0]}", f"--other-node={self.lost_pair[1]}"]
        elif self.victim is not None:
            out.append(f"--victim-node={self.victim}")
        elif k.get("victim_node") is not None:
            out.append(f"--victim-node={k['victim_node']}")
        return out

    @property
    def shape(self) -> str:
        """Trials of one shape share a reference run."""
        if self.config:
            return _file_shape(self.config)
        return KINDS[self.kind].get("shape") or KINDS[self.kind].get("redundancy") or "default"

    @property
    def label(self) -> str:
        """The kind, and the cluster file's name when there is one (a row of the report)."""
        return _label({"trial": {"kind": self.kind, "config": self.config}})


def _file_shape(config: str) -> str:
    return os.path.splitext(os.path.basename(config))[0]


def _label(outcome: dict) -> str:
    """The report row of a recorded trial (records written before cluster files had none)."""
    t = outcome["trial"]
    return f"{t['kind']} @ {_file_shape(t['config'])}" if t.get("config") else t["kind"]


def draw(seed: int, index: int, kinds: list[str], iters: int = 12, config: Optional[str] = None,
         early: bool = False, hosts: bool = False, link_rate: Optional[str] = None) -> Trial:
    """Trial ``index`` of campaign ``seed``: kinds in turn (a shuffled cycle, so every kind gets its
    share), the kill iteration uniform in [3, iters - 3], the delay half the time uniform over an
    iteration (~0.25 s here) and half the time in its first 30 ms, where the copy and the exchange run.
    A second failure strikes 0-4 s after the restarted trainer appeared: while it imports, joins the
    rendezvous or restores."""
    order = list(kinds)
    random.Random(seed * 7919 + index // len(kinds)).shuffle(order)
    rng = random.Random(seed * 1_000_003 + index)
    kind = order[index % len(order)]
    delay = rng.uniform(0.0, 0.25) if rng.random() < 0.5 else rng.uniform(0.0, 0.03)
    iters = KINDS[kind].get("iters", iters)
    kill_at = rng.randint(3, min(iters - 3, KINDS[kind].get("kill_at_max", iters)))
    second = round(rng.uniform(0.0, 4.0), 4) if KINDS[kind].get("second_failure") else 0.0
    # drawn apart from the rest, so that adding them left every other trial of a seed as it was
    extra = random.Random(f"{seed}/{index}/early-and-pairs")
    if KINDS[kind]["fail"] in EARLY_FAILS and (extra.random() < 0.5 or early):
        kill_at, delay = 1, extra.uniform(0.0, EARLY_WINDOW_S)
    pair = None
    if KINDS[kind].get("pairs_of") and not config:
        pair = tuple(sorted(extra.sample(range(KINDS[kind]["pairs_of"]), 2)))
    victim = extra.randrange(KINDS[kind]["victims_of"]) if KINDS[kind].get("victims_of") else None
    return Trial(index, seed, kind, kill_at, round(delay, 4), iters, second, config, pair, hosts, link_rate, victim)


@dataclass
class Outcome:
    trial: dict
    verdict: str  # right | wrong
    why: str = ""
    recovered_from: Optional[str] = None
    promised: Optional[str] = None
    resumed_step: Optional[int] = None
    seconds: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0
    leftovers: list = field(default_factory=list)
    when: str = ""
    restarted_by: Optional[str] = None  # "fast round N", "torchrun restart N" (the demo's summary)
    kept_in_place: list = field(default_factory=list)  # ranks that rejoined in their own processes
    rollbacks: int = 0  # restored versions the guard refused


def classify(trial: Trial, rc: Optional[int], summary: Optional[dict], leftovers: list[str], output: str) -> tuple[str, str]:
    """(verdict, why) of one trial from the demo's exit code (None: it hung), its summary and what
    it left behind. Pure, so the rules are tested without processes."""
    if rc is None:
        return "wrong", "hang"
    if leftovers:
        return "wrong", f"leak: {leftovers[:5]}"
    if KINDS[trial.kind].get("max_restarts") == 0:
        if rc != 0 and "failed with exit code" in output:
            return "right", "the job ended non-zero, cleanly"
        return "wrong", f"max_restarts 0 should end the job non-zero (exit {rc})"
    if summary is None:
        return "wrong", f"crash: no summary (exit {rc})"
    if not summary.get("bitwise_identical"):
        return "wrong", f"mismatch: {(summary.get('problems') or summary.get('details') or [])[:3]}"
    if KINDS[trial.kind].get("elastic"):
        want = summary.get("promised_tier")  # the lost node's: a peer's whole copy, or decoded
        if want not in ("peer_memory", "decoded") or summary.get("recovered_from") != want:
            return "wrong", f"lower-tier: the shrink's lost ranks from {summary.get('recovered_from')}, {want} promised"
        if not (summary.get("grow") or {}).get("step", -1) > summary.get("resumed_step", -1) >= 0:
            return "wrong", f"no grow-back after the shrink at step {summary.get('resumed_step')}"
        return ("right", f"DP {summary['data_parallel_before']} -> {summary['data_parallel_after']} -> "
                         f"{summary['grow']['data_parallel_after']}") if rc == 0 else ("wrong", f"demo exit {rc}")
    if KINDS[trial.kind].get("pause") and summary.get("agent_pause_outcome") not in PAUSE_RIGHT:
        return "wrong", f"agent pause: {summary.get('agent_pause_outcome')} ({summary.get('false_verdicts', [])[:1]})"
    if summary.get("false_verdicts"):
        return "wrong", f"false verdict: {summary['false_verdicts'][:2]}"
    hung = sorted(v["rank"] for v in summary.get("hang_verdicts") or [])
    if KINDS[trial.kind].get("hangs"):
        if len(hung) != KINDS[trial.kind]["hangs"] or not summary.get("hang_ok"):
            return "wrong", f"hang verdicts on {hung}, want {KINDS[trial.kind]['hangs']} on the victim"
    elif hung:
        return "wrong", f"false hang verdict: {summary['hang_verdicts'][:2]}"
    if KINDS[trial.kind].get("pause"):
        return ("right", summary["agent_pause_outcome"]) if rc == 0 else ("wrong", f"demo exit {rc}")
    if KINDS[trial.kind].get("no_failure"):
        if summary.get("restarted_ranks"):
            return "wrong", f"restarted without a failure: rank(s) {summary['restarted_ranks']}"
        if (summary.get("recovered_from") or "none") != "none":
            return "wrong", f"recovered from {summary['recovered_from']} without a failure"
        if rc != 0:
            return "wrong", f"demo exit {rc}"
        return "right", ""
    rollbacks, want = summary.get("rollbacks", 0), KINDS[trial.kind].get("rollbacks", 0)
    if rollbacks != want:  # a poisoned version restored, or a false alarm of the guard
        return "wrong", f"rollbacks: {rollbacks}, want {want}"
    promised = summary.get("promised_tier")
    reached = summary.get("recovered_from") or "none"
    if promised == "none" and summary.get("newest_persisted_before_failure") is None and rc == 0:
        # beyond the redundancy's tolerance before any step was persisted whole: a fresh start is the promise
        return "right", "nothing persisted whole before the loss: a fresh start"
    if promised is None or reached == "none" or not tiers.meets(reached, promised):
        return "wrong", f"lower-tier: {reached} < {promised}"
    if rc != 0:
        return "wrong", f"demo exit {rc}"
    return "right", ""


#: where the demo's agents and spare pools put their sockets (``agent.socket_dir``'s default)
SOCKET_DIR = ftconfig.AgentConfig().socket_dir


def _leftovers(run_tag: str, workdir: str, shm_dir: str, socket_dir: str = SOCKET_DIR) -> list[str]:
    """Segments, Unix sockets, processes and test-bed hosts of a finished trial's run (polled briefly:
    agents shut down async)."""
    from .hosts import bed_namespaces

    deadline = time.time() + 15
    while True:
        socks = [n for n in os.listdir(socket_dir) if n.startswith(f"{run_tag}.")] if os.path.isdir(socket_dir) else []
        segs = [n for n in os.listdir(shm_dir) if n.startswith(f"mft.{run_tag}")] + socks + bed_namespaces()
        procs = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if workdir in " ".join(p.info["cmdline"] or []):
                    procs.append(f"pid {p.info['pid']}")
            except psutil.Error:
                pass
        if not segs and not procs or time.time() > deadline:
            return segs + procs
        time.sleep(0.5)


def run_trial(trial: Trial, workdir: str, timeout: float, shm_dir: str = "/dev/shm",
              references: Optional[str] = None) -> Outcome:
    """One trial in ``workdir``; its reference run kept under ``references`` (default: the workdir's,
    one per shape), reused by later trials of the same job shape."""
    wd = os.path.join(workdir, f"trial{trial.index:04d}")
    ref = references or os.path.join(workdir, "references", trial.shape)
    os.makedirs(wd, exist_ok=True)
    cmd = [sys.executable, "-m", "megatron_ft.cli", "demo", "--quiet", f"--workdir={wd}/demo",
           f"--reference-dir={ref}", f"--timeout={timeout}", *trial.demo_args()]
    if KINDS[trial.kind].get("max_restarts") is not None:
        cfg = ftconfig.replace(ftconfig.load(), launch={"max_restarts": KINDS[trial.kind]["max_restarts"]})
        path = os.path.join(wd, "job.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg.to_dict(), f)
        cmd.append(f"--config={path}")
    load0 = os.getloadavg()[0]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout + 120)
        rc: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        proc.terminate()  # the demo kills its jobs on SIGTERM
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        rc = None
    lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
    summary = json.loads(lines[-1]) if lines else None
    tag = f"demo-{'elastic' if KINDS[trial.kind].get('elastic') else KINDS[trial.kind]['fail']}-{proc.pid}"
    left = _leftovers(tag, wd, shm_dir)
    verdict, why = classify(trial, rc, summary, left, out or "")
    with open(os.path.join(wd, "demo.out"), "w") as f:
        f.write(out or "")
    return Outcome(asdict(trial), verdict, why, (summary or {}).get("recovered_from"),
                   (summary or {}).get("promised_tier"), (summary or {}).get("resumed_step"),
                   round(time.time() - t0, 1), round(load0, 2), round(os.getloadavg()[0], 2), left,
                   time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), (summary or {}).get("restarted_by"),
                   list((summary or {}).get("kept_in_place") or []), int((summary or {}).get("rollbacks") or 0))


def _restart_kind(restarted_by: str) -> str:
    """``"fast round 2"`` -> ``'fast round'``; ``"torchrun restart 1"`` -> ``'torchrun restart'``."""
    return restarted_by.rstrip("0123456789 ")


def tally(outcomes: list[dict]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for o in outcomes:
        row = out.setdefault(_label(o), {"right": 0, "wrong": 0})
        row[o["verdict"]] += 1
    return out


def report(outcomes: list[dict], command: str) -> str:
    t = tally(outcomes)
    loads = [o["load_before"] for o in outcomes]
    lines = ["# Reliability: the chaos campaign", "",
             "Each trial is one `megatron-ft demo` run with a seeded failure (kind, kill iteration, wall-clock delay),",
             "classified against the promised tiers (`megatron_ft/tiers.py`, `docs/architecture.md`): right means",
             "bit-exact at the promised tier or better with nothing left in /dev/shm or running.", "",
             f"Command: `{command}`", "",
             "| kind | trials | right | wrong | tiers reached | resumed steps | restarted by | rollbacks |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in sorted(t):
        r = t[kind]
        mine = [o for o in outcomes if _label(o) == kind]
        reached = sorted({str(o["recovered_from"] or "none (clean exit)") for o in mine})
        steps = sorted({o["resumed_step"] for o in mine if o["resumed_step"] is not None})
        how = sorted({_restart_kind(o.get("restarted_by")) + (" (survivors in place)" if o.get("kept_in_place") else "")
                      for o in mine if o.get("restarted_by")})
        lines.append(f"| {kind} | {r['right'] + r['wrong']} | {r['right']} | {r['wrong']} | {', '.join(reached)} "
                     f"| {', '.join(map(str, steps)) or '-'} | {', '.join(how) or '-'} "
                     f"| {sum(o.get('rollbacks', 0) for o in mine)} |")
    total_r = sum(r["right"] for r in t.values())
    total_w = sum(r["wrong"] for r in t.values())
    lines.append(f"| **all** | {total_r + total_w} | {total_r} | {total_w} | | | | "
                 f"{sum(o.get('rollbacks', 0) for o in outcomes)} |")
    if loads:
        lines += ["", f"Load average (1 min) before each trial: min {min(loads):.2f}, median "
                      f"{sorted(loads)[len(loads) // 2]:.2f}, max {max(loads):.2f}; "
                      f"{outcomes[0]['when'][:10]} to {outcomes[-1]['when'][:10]}."]
    wrong = [o for o in outcomes if o["verdict"] == "wrong"]
    if wrong:
        lines += ["", "## Wrong trials", ""]
        lines += [f"- trial {o['trial']['index']} ({_label(o)}, kill at {o['trial']['kill_at']} "
                  f"+{o['trial']['kill_delay']} s): {o['why']}" for o in wrong]
    return "\n".join(lines) + "\n"


def read_results(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(ln) for ln in f if ln.strip()]
    except FileNotFoundError:
        return []


def main(args: argparse.Namespace) -> int:
    config = os.path.abspath(args.config) if args.config else None
    allowed = list(CONFIG_KINDS) if config else [k for k, v in KINDS.items() if not v.get("config_only")]
    kinds = args.kinds.split(",") if args.kinds else [k for k in allowed if k not in OPT_IN_KINDS]
    bad = [k for k in kinds if k not in allowed]
    if bad:
        raise ftconfig.ConfigError(f"--kinds: {bad} not among {allowed}" + (" (with --config)" if config else ""))
    if config:
        ftconfig.load(config)  # a bad file is refused here, not in every trial
    results = os.path.abspath(args.results)
    os.makedirs(os.path.dirname(results), exist_ok=True)
    done = {o["trial"]["index"] for o in read_results(results)
            if o["trial"]["seed"] == args.seed and o["trial"].get("config") == config}
    for i in range(args.start, args.start + args.trials):
        if i in done:
            continue
        trial = draw(args.seed, i, kinds, config=config, early=getattr(args, "early", False),
                     hosts=getattr(args, "hosts", False), link_rate=getattr(args, "link_rate", None))
        o = run_trial(trial, os.path.abspath(args.workdir), args.trial_timeout)
        with open(results, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(o)) + "\n")
        print(f"[chaos] trial {i} {trial.label} kill_at={trial.kill_at} +{trial.kill_delay}s: {o.verdict}"
              f"{' (' + o.why + ')' if o.why else ''} [{o.recovered_from} step {o.resumed_step}, "
              f"{o.seconds} s, load {o.load_before}]", flush=True)
    outcomes = [o for o in read_results(results) if o["trial"]["seed"] == args.seed]
    if args.docs:
        with open(args.docs, "w", encoding="utf-8") as f:
            f.write(report(outcomes, " ".join(["megatron-ft chaos", *sys.argv[2:]])))
    wrong = sum(o["verdict"] == "wrong" for o in outcomes)
    print(f"[chaos] seed {args.seed}: {len(outcomes)} trials, {wrong} wrong; {tally(outcomes)}", flush=True)
    return 1 if wrong else 0


def add_parser(sub) -> None:
    p = sub.add_parser("chaos", help="a seeded campaign of failures, each classified against the promised tiers")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--trials", type=int, default=10, help="trials in this batch")
    p.add_argument("--start", type=int, default=0, help="first trial index of this batch")
    p.add_argument("--kinds", default=None, help=f"comma-separated subset of {list(KINDS)} (default: all but "
                                                 f"the cluster-file kinds and {list(OPT_IN_KINDS)}, drawn only when named)")
    p.add_argument("--config", default=None,
                   help=f"run every trial on this cluster file (its shape and scheme), e.g. configs/cpu/*.yaml; "
                        f"kinds among {list(CONFIG_KINDS)}")
    p.add_argument("--workdir", default="/tmp/megatron-ft/chaos")
    p.add_argument("--results", default="/tmp/megatron-ft/chaos/results.jsonl",
                   help="JSON lines, appended; trials already there are skipped (resume)")
    p.add_argument("--trial-timeout", type=float, default=300.0, help="a trial past this is a hang")
    p.add_argument("--hosts", action="store_true",
                   help="every trial's nodes on hosts of their own (demo --hosts; root, namespaces)")
    p.add_argument("--link-rate", default=None,
                   help="with --hosts: every link's rate (tc tbf, e.g. 200mbit; checkpoint and training traffic share it)")
    p.add_argument("--early", action="store_true",
                   help="every node and two-node loss strikes within the first second after the first iteration "
                        "(else half of them)")
    p.add_argument("--docs", default=None, help="write the tally (markdown) here, e.g. docs/reliability.md")
    p.set_defaults(func=main)
