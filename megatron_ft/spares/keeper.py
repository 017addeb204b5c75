"""The keeper: forked by the pool (:mod:`.pool`) for one worker, it forks that worker's trainer,
reports the trainer's pid and exit to the worker (:mod:`.worker`), forwards torchrun's signals, and
runs the fast restart rounds of :mod:`.fast_restart` (a failed trainer replaced from the warm
zygote's memory without torchrun noticing). With in-process restart on (``MFT_IN_PROCESS_GRACE_S``)
each trainer also gets a control socket: a surviving trainer that said it can is asked to rejoin a
new round in its own process (:mod:`megatron_ft.trainer.in_process`) instead of being killed, and is
replaced by a fresh fork in that round only when it has not unwound within the grace or ends instead
(it found it cannot rejoin: its device, its NCCL abort).

The rounds and the root's verdicts come from the node's watcher (:mod:`.node_watch`, over the socket
the pool handed this keeper): it follows torchrun's job store and the root for all the node's keepers
and tells each what changed (``opened``, ``port``, ``gone``, ``verdict``); this keeper asks it to
``open`` a round, to ``publish`` the port of a round's store it hosts, and for ``verdicts`` while a
round settles. So a keeper sends no request to any store: per round a handful of packets on a local
socket, idle none. It sleeps in one ``select`` on its worker, its trainer (a pidfd: its exit wakes it),
the trainer's control socket and the watcher's socket, at most :data:`IDLE_TICK_S` (then
:data:`~megatron_ft.spares.fast_restart.POLL_S` where the kernel has no pidfds).

Contracts: single-threaded (it forks trainers); owns its trainer (SIGKILLed when the worker goes
away, so no trainer outlives the worker torchrun watches) and, on torchrun's rank 0, the store of
the current round; both die with it (``PR_SET_PDEATHSIG``). The worker's standard streams stay open
here for the trainers of later rounds. A job store that fails (the watcher's ``gone``), or a watcher
that ends, ends the rounds and reports the trainer's failure to torchrun instead.
"""
from __future__ import annotations

import atexit
import logging
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
from typing import Optional

from . import fast_restart as fr
from ..health import progress as hp
from ..transport import wire
from .lifetime import die_with_parent
from .messages import FROM_TRAINER, FROM_WATCHER, FROM_WORKER, Failed, Gone, Opened, Rejoinable, Restarting, \
    RoundOpened, Verdict

log = logging.getLogger("megatron_ft.spares")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL, signal.SIGUSR1, signal.SIGUSR2)
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL)  # torchrun ending its workers
IDLE_TICK_S = 1.0  # the longest a keeper sleeps in select (every event wakes it sooner: a bound, not a poll)


class RoundsGone(Exception):
    """No more fast rounds in this attempt: the job's store is gone, or the node's watcher."""


def send(conn: socket.socket, obj: dict) -> None:
    """One message to the worker (best effort: a worker that is gone hears nothing)."""
    try:
        wire.send_packet(conn, obj)
    except OSError:
        pass


class Keeper:
    def __init__(self, conn: socket.socket, req: dict, fds: list[int], watch: Optional[socket.socket] = None):
        self.conn, self.req, self.fds = conn, req, fds
        self.watch = watch  # the node's watcher (node_watch.py): rounds and verdicts, pushed
        self.env = dict(req["env"])
        fr.adopt_trainer_port(self.env)  # the job store at launch.trainer_port, for this keeper and its trainers
        self.round = fr.Round(0, fr.budget(self.env))
        self.trainer: Optional[int] = None
        self.pidfd: Optional[int] = None  # the trainer's (readable once it exited)
        self.joining: Optional[int] = None  # a round opened, its trainer not forked yet
        self.newest = 0  # the newest round opened, as the watcher said
        self.ports: dict[int, int] = {}  # round -> its store's port, as the watcher said (or we host it)
        self.host: Optional[tuple[int, int, int]] = None  # (round, pid, port) of the round store we host
        self.job_host: Optional[int] = None  # pid of the job's store we host (torchrun's rank 0)
        self.verdict: Optional[str] = None  # the root's last_verdict, as the watcher said
        self.round_started = 0.0
        self.started = time.time()  # this torchrun attempt's start, as far as this worker knows
        self.settle_s = 0.0
        # in-process restart (megatron_ft/trainer/in_process.py): the trainer's control socket, whether
        # the trainer said it can rejoin a round in place, and the round it was asked to rejoin
        self.in_process = fr.in_process_grace(self.env) if self.round.budget else None
        self.ctl: Optional[socket.socket] = None
        self.ctl_ready = False
        self.asked: Optional[tuple[int, float, dict]] = None  # (round, deadline, a fresh trainer's env)

    # ------------------------------------------------------------------ trainers
    def fork_trainer(self, env: dict) -> int:
        self.close_ctl()
        theirs = None
        if self.in_process is not None:
            self.ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            env = dict(env, MFT_IN_PROCESS_FD=str(theirs.fileno()))
        pid = os.fork()
        if pid == 0:
            die_with_parent()
            self.conn.close()
            for sock in (self.ctl, self.watch):
                if sock is not None:
                    sock.close()
            if self.pidfd is not None:
                os.close(self.pidfd)
            if theirs is not None:
                theirs.detach()  # the trainer's end, by number (its environment says which)
            run_trainer(dict(self.req, env=env), self.fds)
        if theirs is not None:
            theirs.close()
        if self.pidfd is not None:  # the previous trainer's
            os.close(self.pidfd)
        try:
            self.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfds here: the loop looks every POLL_S
            self.pidfd = None
        return pid

    def forget_trainer(self) -> None:
        """The trainer was reaped (or is being replaced): no pid, no pidfd."""
        self.trainer = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def close_ctl(self) -> None:
        if self.ctl is not None:
            self.ctl.close()
        self.ctl, self.ctl_ready, self.asked = None, False, None

    def tell(self, obj: dict) -> bool:
        """Send ``obj`` to the trainer's control socket; False when it is gone."""
        if self.ctl is None:
            return False
        try:
            wire.send_packet(self.ctl, obj)
            return True
        except OSError:
            return False

    def kill_trainer(self) -> None:
        self.close_ctl()
        if self.trainer is None:
            return
        try:
            os.kill(self.trainer, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.trainer, 0)
        self.forget_trainer()

    # ------------------------------------------------------------------ rounds
    def job_store(self) -> dict:
        """The environment of this worker's trainers, whose store (``MASTER_PORT``, fresh per torchrun
        attempt) outlives them: the keeper of torchrun's rank 0 hosts it where its rank-0 trainer
        would (see :mod:`.fast_restart`). A torchrun that shares its own store gets no fast restarts."""
        env = self.env
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # shared across torchrun's attempts: no
            self.round = fr.Round(0, 0)  # fresh keys per attempt to hold the rounds in
            return env
        if env.get("RANK") == "0":
            try:
                self.job_host, _ = fr.host_round_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                                                       stamp=fr.store_stamp(env))
            except (RuntimeError, OSError, ValueError) as e:  # the port is taken: rank 0's trainer hosts
                log.error("spares: no job store at %s:%s (%s): no fast restarts", env["MASTER_ADDR"],
                          env["MASTER_PORT"], e)
                self.round = fr.Round(0, 0)
                return env
        return dict(env, TORCHELASTIC_USE_AGENT_STORE="True", MFT_FRESH_STORE="1")

    def follow_rounds(self) -> None:
        """Ask the node's watcher for this attempt's rounds (their news comes to :meth:`from_watch`)."""
        env = self.env
        attempt = f"{fr.store_stamp(env)}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # the stamp first
        try:
            if self.watch is None:
                raise OSError("no node watcher")
            self.to_watch({"op": "rounds", "addr": env["MASTER_ADDR"], "port": int(env["MASTER_PORT"]),
                           "attempt": attempt, "limit": self.round.budget})
        except (OSError, ValueError) as e:
            log.error("spares: rank %s: no fast restarts (%s)", env.get("RANK"), e)
            self.round = fr.Round(0, 0)

    def to_watch(self, msg: dict) -> None:
        """One message to the node's watcher; an ``OSError`` when it is gone."""
        if self.watch is None:
            raise OSError("the node's watcher is gone")
        wire.send_packet(self.watch, msg)

    def open_next(self) -> None:
        """Open the round after ours (the watcher adds it to the job's store, once per node); the loop
        goes to it (:meth:`advance`)."""
        self.to_watch({"op": "open", "round": self.round.number + 1})
        self.joining = self.round.number + 1

    def from_watch(self) -> None:
        """Handle one message of the node's watcher: a newer round, its store's port, the job's store
        gone (:class:`RoundsGone`), the root's newest verdict."""
        try:
            msg, _ = wire.recv_packet(self.watch, FROM_WATCHER)  # type: ignore[arg-type]
        except wire.WireError as e:
            log.error("spares: rank %s: node watcher: %s", self.env.get("RANK"), e)
            return
        except OSError:
            self.watch.close()  # type: ignore[union-attr]
            self.watch = None
            raise RoundsGone("the node's watcher ended") from None
        if isinstance(msg, Verdict):
            self.verdict = msg.value
            return
        if isinstance(msg, Gone):
            raise RoundsGone(msg.reason)
        if isinstance(msg, RoundOpened):
            self.ports[msg.round] = msg.port
        if isinstance(msg, (Opened, RoundOpened)):
            self.newest = max(self.newest, msg.round)

    def advance(self) -> None:
        """Join a newer round; start the one we join once its store's port is known (torchrun's rank 0
        hosts it, and tells the watcher its port). No I/O but at a round's turn (called every loop)."""
        if self.round.budget == 0 or self.round.stopping:
            return
        target = fr.joins(self.round, max(min(self.newest, self.round.budget), self.joining or 0))
        if target is not None and target != self.joining:
            if not self.ctl_ready:  # alive in an older round: blocked on a failed peer, or fine
                if self.trainer is not None:
                    log.warning("spares: rank %s: trainer %s cannot rejoin round %d in place (not ready to be asked): "
                                "replaced", self.env.get("RANK"), self.trainer, target)
                self.kill_trainer()
            self.joining = target
        if self.joining is None:
            return
        if self.env.get("RANK") == "0" and (self.host is None or self.host[0] != self.joining):
            self.stop_host()
            pid, port = fr.host_round_store(self.env["MASTER_ADDR"], fr.round_port(self.env, self.joining))
            self.host = (self.joining, pid, port)
            self.ports[self.joining] = port
            self.to_watch({"op": "publish", "round": self.joining, "port": port})
        port = self.ports.get(self.joining)
        if port is None:
            return
        n, self.joining = self.joining, None
        self.round = fr.Round(n, self.round.budget, self.round.stopping)
        env = dict(self.env, MASTER_PORT=str(port), MFT_FAST_ROUND=str(n))
        if self.trainer is not None and self.ctl_ready and self.tell({"op": "round", "round": n, "port": port}):
            self.asked = (n, time.monotonic() + (self.in_process or 0.0), env)  # it rejoins in place, or
        else:  # is replaced once the grace is over (see check_asked)
            self.kill_trainer()
            self.trainer = self.fork_trainer(env)
        if not self.settle_s:
            self.settle_s = _health_timeout(self.env) + 1.0
        self.round_started = time.monotonic()
        try:  # the root's verdicts while this round settles (best effort)
            self.to_watch({"op": "verdicts", "config": self.env.get("MFT_CONFIG", ""), "settle_s": self.settle_s})
        except OSError:
            pass
        log.warning("spares: rank %s: round %d, trainer pid %d%s", self.env.get("RANK"), n, self.trainer,
                    " (asked to rejoin in place)" if self.asked else "")

    def check_asked(self) -> None:
        """A trainer asked to rejoin a round in place that has not said ``restarting`` within the grace
        (stuck where no abort reaches) is replaced by a fresh fork."""
        if self.asked is None or time.monotonic() < self.asked[1]:
            return
        if self.trainer is None:  # it exited meanwhile: its exit opened the next round
            self.asked = None
            return
        n, _, env = self.asked
        log.warning("spares: rank %s: trainer %s did not rejoin round %d in place within %.1f s: replaced",
                    self.env.get("RANK"), self.trainer, n, self.in_process or 0.0)
        self.kill_trainer()
        self.trainer = self.fork_trainer(env)

    def from_trainer(self) -> None:
        """Handle one message of the trainer's control socket."""
        try:
            msg, _ = wire.recv_packet(self.ctl, FROM_TRAINER)  # type: ignore[arg-type]
        except wire.WireError as e:
            log.error("spares: rank %s: trainer control: %s", self.env.get("RANK"), e)
            return
        except OSError:  # the trainer ended (its exit is collected by waitpid)
            self.close_ctl()
            return
        if isinstance(msg, Rejoinable):
            self.ctl_ready = True
        elif isinstance(msg, Restarting):
            if self.asked is not None and msg.round == self.asked[0]:
                self.asked = None
            log.warning("spares: rank %s: trainer %s rejoins round %s in place", self.env.get("RANK"),
                        self.trainer, msg.round)
        elif isinstance(msg, Failed) and self.joining is None and self.asked is None:
            # the trainer's own failure (a peer's death reached it first), as if it had exited with 1
            lost = self.round.number > 0 and self.node_lost()
            if fr.after_exit(self.round, 1, lost) == fr.REPORT:
                self.tell({"op": "exit"})  # it raises and exits; its exit is reported
                return
            try:
                self.open_next()
            except Exception as e:
                log.error("spares: rank %s: no fast restart (%s)", self.env.get("RANK"), e)
                self.tell({"op": "exit"})
                return
            log.warning("spares: rank %s: trainer failed in place (%s); round %d opened", self.env.get("RANK"),
                        msg.reason, self.joining)

    def node_lost(self) -> bool:
        """A node verdict since this torchrun attempt began, while this round's trainers may still wait
        for a rank of that node (within ``health.timeout_s`` + 1 s of the round's start). No I/O: the
        watcher pushed the root's newest verdict (:meth:`from_watch`)."""
        if self.verdict is None or time.monotonic() - self.round_started > self.settle_s:
            return False
        return fr.verdict_time(self.verdict) >= self.started

    def stop_host(self) -> None:
        if self.host is not None:
            _end(self.host[1])
            self.host = None

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        if self.round.budget:
            self.env = self.job_store()
        if self.round.budget:
            self.follow_rounds()
        if not self.round.budget and self.watch is not None:  # no rounds: nothing to hear from the watcher
            self.watch.close()
            self.watch = None
        self.trainer = self.fork_trainer(self.env)
        send(self.conn, {"op": "started", "pid": self.trainer})
        try:
            code = self._loop()
            if code is not None:
                send(self.conn, {"op": "exited", "code": code})
        finally:
            self.kill_trainer()
            self.stop_host()
            if self.job_host is not None:
                _end(self.job_host)
            for fd in self.fds:
                os.close(fd)

    def rounds_over(self, e: Exception) -> None:
        """The job's store is gone (its host ended: the job is ending, or torchrun's rank 0 failed), or
        the watcher, or a round's store could not be hosted: no more rounds; a trainer still running
        goes on."""
        if self.round.budget:
            log.warning("spares: rank %s: no fast restarts any more (%s)", self.env.get("RANK"),
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
        self.round = fr.Round(self.round.number, 0, self.round.stopping)

    def _timeout(self) -> float:
        """How long the loop may sleep: until the grace of a trainer asked to rejoin runs out, at most
        :data:`IDLE_TICK_S` (:data:`~.fast_restart.POLL_S` without a pidfd to wake it at the trainer's exit)."""
        t = IDLE_TICK_S if self.pidfd is not None or self.trainer is None else fr.POLL_S
        if self.asked is not None:
            t = min(t, max(0.0, self.asked[1] - time.monotonic()))
        return t

    def _loop(self) -> Optional[int]:
        """Returns the exit status to report, or None when the worker went away."""
        while True:
            if self.trainer is not None:
                done, status = os.waitpid(self.trainer, os.WNOHANG)
                if done:
                    self.forget_trainer()
                    code = os.waitstatus_to_exitcode(status)
                    lost = self.round.number > 0 and self.node_lost()
                    if self.asked is not None and fr.rejoins_fresh(self.round, code, lost):
                        # it gave up rejoining in place (its device, its NCCL abort): a fresh fork takes
                        # its place in the round it was asked to join, as when the grace runs out
                        n, _, env = self.asked
                        log.warning("spares: rank %s: trainer exited with %d instead of rejoining round %d in "
                                    "place: replaced", self.env.get("RANK"), code, n)
                        self.trainer = self.fork_trainer(env)
                        continue
                    if fr.after_exit(self.round, code, lost) == fr.REPORT:
                        return code
                    try:
                        self.open_next()
                    except Exception as e:  # the watcher is gone, or no round store here: torchrun's restart
                        log.error("spares: rank %s: no fast restart (%s)", self.env.get("RANK"), e)
                        return code
                    log.warning("spares: rank %s: trainer exited with %d; round %d opened", self.env.get("RANK"),
                                code, self.joining)
            try:
                if self.round.budget and not self.round.stopping:
                    self.advance()
            except Exception as e:
                self.rounds_over(e)
                if self.trainer is None:
                    return 1  # between rounds: torchrun restarts the job
            if (self.round.budget and not self.round.stopping and self.trainer is not None and self.round.number > 0
                    and self.node_lost()):
                log.error("spares: rank %s: a node was lost during round %d: torchrun restarts",
                          self.env.get("RANK"), self.round.number)
                self.kill_trainer()
                return 1
            if self.trainer is None and self.joining is None:
                return 1  # cannot happen: an exit is reported or a round is being joined
            self.check_asked()
            watched = [self.conn] + [x for x in (self.ctl, self.watch, self.pidfd) if x is not None]
            ready, _, _ = select.select(watched, [], [], self._timeout())
            if self.watch is not None and self.watch in ready:
                try:
                    self.from_watch()
                except RoundsGone as e:
                    self.rounds_over(e)
                    if self.trainer is None:
                        return 1  # between rounds: torchrun restarts the job
            if self.ctl is not None and self.ctl in ready:
                self.from_trainer()
            if self.conn not in ready:
                continue
            try:  # a signal the worker forwards (torchrun stopping its workers)
                sig = wire.recv_packet(self.conn, FROM_WORKER)[0].signal
            except wire.WireError as e:
                log.error("spares: rank %s: worker: %s", self.env.get("RANK"), e)
                continue
            except OSError:  # the worker was killed: so is its trainer
                return None
            if sig in STOPS:
                self.round = self.round.stop()
                if self.trainer is None:  # between rounds: nothing to stop
                    return -sig
            if sig in FORWARDED and self.trainer is not None:
                try:
                    os.kill(self.trainer, sig)
                except ProcessLookupError:
                    pass


def _end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _health_timeout(env: dict) -> float:
    try:
        from .. import config as ftconfig

        return ftconfig.load(env.get("MFT_CONFIG")).health.timeout_s
    except Exception:
        return 5.0


def keep(conn: socket.socket, req: dict, fds: list[int], watch: Optional[socket.socket] = None) -> None:
    """In the keeper process (forked by the pool): serve one worker until its trainer ends. ``watch``:
    this keeper's socket to the node's watcher (:mod:`.node_watch`; None: no fast restarts)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _log_beside_the_trainer(fds[2])
    Keeper(conn, req, fds, watch).run()


def _log_beside_the_trainer(stderr_fd: int) -> None:
    """The keeper's log lines (its rounds, a trainer replaced or kept in place) go where its worker's
    standard error goes - torchrun's output, the job's run log - beside its trainer's, instead of
    into the pool's log. Line-buffered. The pool's own set-up is kept aside for the trainers it forks
    (:func:`run_trainer` puts it back: their lines look as before)."""
    global _POOL_LOGGING
    root = logging.getLogger()
    _POOL_LOGGING = (list(root.handlers), root.level)
    handler = logging.StreamHandler(os.fdopen(os.dup(stderr_fd), "w", buffering=1))
    handler.setFormatter(logging.Formatter("[keeper %(asctime)s] %(levelname)s %(message)s"))
    root.handlers = [handler]
    root.setLevel(logging.INFO)


_POOL_LOGGING: Optional[tuple[list, int]] = None  # the root logger's handlers and level as the pool set them


# ---------------------------------------------------------------------- the trainer's side
def run_trainer(req: dict, fds: list[int]) -> None:
    """In the trainer process: become the worker torchrun started, then run its script."""
    if _POOL_LOGGING is not None:  # not the keeper's handler: the trainer logs as the pool set it up
        logging.getLogger().handlers, level = list(_POOL_LOGGING[0]), _POOL_LOGGING[1]
        logging.getLogger().setLevel(level)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    # what a fresh interpreter seeds from the OS at import is seeded again, so trainers do not share it
    if "random" in sys.modules:
        sys.modules["random"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    argv = list(req["argv"])
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 0
    module = argv[1] if argv and argv[0] in ("-m", "--module") else None
    if module is not None:
        sys.argv = [module, *argv[2:]]
        sys.path[0] = os.getcwd()  # as `python -m` has it
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    if os.environ.get(hp.ENV):  # where this trainer is, from its first moment (the node agent's hang watch)
        hp.writer_for_process(os.environ[hp.ENV], int(os.environ.get("LOCAL_RANK", 0)))
    try:
        from . import run_per_trainer

        run_per_trainer()  # what the zygote's imports did per process, done for this one
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
        if code:
            sys.last_value = e  # the exit handlers see an error exit (megatron_ft.trainer.progress.ended_well)
    except BaseException as e:
        import traceback

        traceback.print_exc()
        code = 1
        sys.last_value = e  # as the interpreter sets it for an exception that reached the top
    finally:
        _interpreter_exit()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
    os._exit(code)  # not a return: the keeper's stack, forked with us, must not unwind here


def _interpreter_exit() -> None:
    """What a cold interpreter runs at exit before it ends: non-daemon threads joined, then the
    ``atexit`` handlers (a script's own, e.g. upstream Megatron-LM's local checkpoint manager saying
    goodbye to its agent, registered only in this forked trainer)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as Py_FinalizeEx: wait for non-daemon threads
    except Exception as e:
        print(f"megatron-ft spare: waiting for the script's threads at exit failed: {e}", file=sys.stderr)
    atexit._run_exitfuncs()
