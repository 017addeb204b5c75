"""A node's warm spare trainers: one process that has already imported torch and megatron-core
(the *zygote*) and forks a ready trainer for each worker torchrun starts.

A restarted trainer spends most of its recovery importing Python packages (on the demo, ~80 % of
kill -> first iteration). The launcher starts this pool before torchrun, next to the agent, and
keeps it for the whole job (a standby launcher starts its own, so a node that takes over is warm
too). torchrun stays in charge of the workers: what it starts is :mod:`.worker`, a small process
that asks the pool for a trainer, hands it its environment, arguments, working directory and
standard streams, and mirrors it (its exit status; the signals torchrun sends). torchrun's
monitoring, restarts and rendezvous are unchanged; only the imports are already done.

Processes (all on one node)::

    launcher ── pool (zygote: imports done, single-threaded, accepts requests)
                  └─ keeper (one per worker, :mod:`.keeper`: forks its trainer, reports its exit,
                     │       runs the fast restart rounds of :mod:`.fast_restart`)
                     ├─ trainer (forked from the keeper: runs the training script as __main__)
                     └─ round store (torchrun's rank 0 only, during a fast restart round)
                  └─ watcher (one per node, :mod:`.node_watch`: follows the rounds in torchrun's store
                             and the root's verdicts for all the node's keepers, woken by the stores)
    torchrun ── worker (spares.worker: waits for its trainer, forwards signals, exits as it did)

Contracts:

* one request per connection on a ``SOCK_SEQPACKET`` Unix socket in the wire's packet form
  (:mod:`megatron_ft.spares.messages`: versioned, typed, at most 1 MiB; file descriptors passed with
  ``SCM_RIGHTS``): ``spawn`` (argv, env, cwd) with the worker's stdin, stdout and stderr; replies
  ``started`` (pid: the trainer is running), then ``exited`` (code; a signal as ``-N``). JSON only;
  nothing is pickled.
* the keeper kills its trainer (SIGKILL) when the worker's connection closes without an answer
  (the worker was killed), so no trainer outlives the worker torchrun watches; keepers and
  trainers die with the pool (``PR_SET_PDEATHSIG``), and the pool with its launcher.
* the zygote stays single-threaded (a fork copies only the calling thread) and never initialises
  CUDA (a forked child could not use it); a trainer re-reads the thread settings of its environment.
* a worker that finds no pool (none started, or it died) runs the script itself, cold, as before.
* each keeper gets a socket to the node's watcher (forked at the first request, again if it died;
  it never forks, so it may run threads): the keepers send no request to any store themselves.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: subprocess is imported where a process is started
    import subprocess

from ..agent.protocol import spares_socket_path
from ..clock import Deadline
from ..transport import wire
from ..transport.wire import bind_private, stranger
from .lifetime import die_with_parent
from .messages import POOL

log = logging.getLogger("megatron_ft.spares")

#: imported before any fork, for every job; a module missing here is skipped
BASE_IMPORTS = ("numpy", "yaml", "pydantic", "psutil", "torch", "torch.distributed", "megatron_ft.config",
                "megatron_ft.trainer.checkpointer")
#: more, when the training script imports the package (its top-level imports are read, not run)
PACKAGE_IMPORTS = {
    "megatron": ("megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
                 "megatron.core.pipeline_parallel", "megatron.core.distributed", "megatron.core.transformer",
                 "megatron.core.tensor_parallel", "megatron_ft.megatron.state", "megatron_ft.megatron.hooks",
                 "megatron_ft.megatron.cpu_compat"),
    "deepspeed": ("deepspeed", "megatron_ft.deepspeed.engine"),
}
DEFAULT_IMPORTS = BASE_IMPORTS + PACKAGE_IMPORTS["megatron"]


def imports_for(script: list[str]) -> tuple[str, ...]:
    """What to import for the training command ``script`` (a path and its arguments, or ``-m
    MODULE ...``): the base set, plus megatron-core's or DeepSpeed's modules when the top-level
    imports of the script - or of any ``.py`` file among its arguments, as when a wrapper runs the
    real script - name them; a package the script's own tree provides (upstream Megatron-LM's
    ``megatron/``) is imported from that tree (:func:`own_trees`, put on the pool's ``sys.path``),
    and so is every module of ``megatron`` the script names at its top level (upstream's
    ``megatron.training`` among them: its per-process set-up runs again in each trainer, see
    :func:`megatron_ft.spares.for_each_trainer`). Nothing of the script itself runs."""
    paths = _script_paths(script)
    if not paths:
        return DEFAULT_IMPORTS
    named = [m for path in paths for m in _top_level_imports(path)]
    top = {m.split(".")[0] for m in named}
    out = BASE_IMPORTS + tuple(m for pkg, mods in PACKAGE_IMPORTS.items() if pkg in top for m in mods)
    return out + tuple(m for m in dict.fromkeys(named) if m.split(".")[0] == "megatron" and m not in out)


def _top_level_imports(path: str) -> list[str]:
    """The modules a script names at its top level (``import a.b``, ``from a.b import c``: ``a.b``;
    relative imports left out), in order; none when it cannot be read or parsed."""
    import ast

    try:
        tree = ast.parse(open(path).read(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    out: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
    return out


def own_trees(script: list[str]) -> tuple[str, ...]:
    """The directories of the training command's scripts that provide a package of
    :data:`PACKAGE_IMPORTS` themselves (upstream Megatron-LM's tree, with its ``megatron/``): the
    pool imports from there, as the trainer would (the script's directory comes first on its
    ``sys.path``), so no installed copy shadows the tree."""
    out: list[str] = []
    for path in _script_paths(script):
        d = os.path.dirname(os.path.abspath(path))
        if d not in out and any(os.path.isdir(os.path.join(d, pkg)) for pkg in PACKAGE_IMPORTS):
            out.append(d)
    return tuple(out)


def _script_paths(script: list[str]) -> list[str]:
    """The ``.py`` files of a training command (a path and its arguments, or ``-m MODULE ...``)."""
    import importlib.util

    paths = [a for a in script if a.endswith(".py") and os.path.isfile(a)]
    if script and script[0] in ("-m", "--module") and len(script) > 1:
        try:
            spec = importlib.util.find_spec(script[1])
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin:
            paths.append(spec.origin)
    return paths


socket_path = spares_socket_path  # where node N's pool listens


def warm_up(modules: tuple[str, ...]) -> list[str]:
    """Import ``modules`` (the expensive part of a trainer's start); returns those imported."""
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as e:  # not installed here, or fails without the job's setup: the trainer imports it
            log.info("spares: not pre-importing %s (%s)", name, e)
    return done


def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """A worker's ``spawn`` request (its fields) and its three standard streams; a ``WireError`` (the
    descriptors closed) for anything else."""
    req, fds = wire.recv_packet(conn, POOL, max_fds=3)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise wire.WireError(f"a spawn request with {len(fds)} standard streams, 3 expected")
    return req.model_dump(include={"argv", "env", "cwd"}), fds


def serve(path: str, imports: tuple[str, ...] = DEFAULT_IMPORTS, trees: tuple[str, ...] = ()) -> None:
    """The zygote: warm up (``trees`` before the installed packages on ``sys.path``), then fork a
    keeper (and through it a trainer) per request. Never returns; ends with its launcher
    (PR_SET_PDEATHSIG) or a signal."""
    t0 = time.time()
    sys.path[1:1] = list(trees)  # after [0], which a trainer sets to its script's directory
    # an import that asks torch.cuda.is_available() must not initialise the driver here (a forked
    # trainer could not use CUDA then): NVML answers instead (GPU path; not run on this project's CI)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    done = warm_up(imports)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise SystemExit("spares: an import initialised CUDA in the pool; its forks could not use it: "
                         "the job's trainers start cold")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    bind_private(srv, path, backlog=64)  # listening before its name appears: a worker connects to a warm pool
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers (and the watcher) are reaped by the kernel
    from .node_watch import WatcherHandle

    watcher = WatcherHandle()
    log.warning("spares: warm in %.1f s (%s); serving on %s", time.time() - t0, ", ".join(done), path)
    while True:
        conn, _ = srv.accept()
        who = stranger(conn)
        if who is not None:  # never a fork, nor a read, for another user's process
            log.error("spares: refused a connection from %s", who)
            conn.close()
            continue
        try:
            req, fds = recv_request(conn)
        except ConnectionError:  # closed before its request: a probe whether the pool still listens
            conn.close()
            continue
        except (OSError, wire.WireError) as e:
            log.error("spares: bad request: %s", e)
            conn.close()
            continue
        watch = watcher.attach((srv, conn, *fds))
        if os.fork() == 0:
            srv.close()
            watcher.close()
            die_with_parent()
            try:
                from .keeper import keep

                keep(conn, req, fds, watch)
            except BaseException:
                import traceback

                traceback.print_exc()  # into the pool's log
            finally:
                os._exit(0)
        conn.close()
        if watch is not None:
            watch.close()
        for fd in fds:
            os.close(fd)


# ---------------------------------------------------------------------- the launcher's side
def start(path: str, log_path: str, imports: tuple[str, ...] = DEFAULT_IMPORTS,
          trees: tuple[str, ...] = ()) -> "subprocess.Popen":
    """Start a pool serving on ``path`` (it dies with the calling launcher); see :func:`wait_warm`.
    ``trees``: directories imported from before the installed packages (:func:`own_trees`)."""
    import subprocess

    logf = open(log_path, "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "megatron_ft.spares.pool", "--socket", path,
                                 "--imports", ",".join(imports), *(f"--tree={t}" for t in trees)],
                                stdout=logf, stderr=subprocess.STDOUT)
    finally:
        logf.close()


def wait_warm(proc: "subprocess.Popen", path: str, timeout_s: float) -> Optional[str]:
    """Wait until the pool listens (its imports done); None when warm, else why not (it exited,
    or ``timeout_s`` passed: then it is stopped and the job starts its trainers cold)."""
    deadline = Deadline(timeout_s, "the spare pool warming up")
    while not os.path.exists(path):
        if proc.poll() is not None:
            return f"the spare pool exited with {proc.returncode} while warming up"
        if deadline.expired():
            stop(proc, path)
            return f"the spare pool was not warm within {timeout_s:g} s"
        deadline.pause(0.05)
    return None


def stop(proc: "subprocess.Popen", path: str) -> None:
    """Stop the pool (its keepers and idle trainers die with it) and remove its socket."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except Exception:
            proc.kill()
            proc.wait()
    for p in (path, path + ".tmp"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="a node's warm spare trainers (started by megatron-ft launch)")
    p.add_argument("--socket", required=True)
    p.add_argument("--imports", default=",".join(DEFAULT_IMPORTS))
    p.add_argument("--tree", action="append", default=[], help="import from this directory first (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    die_with_parent()
    serve(args.socket, tuple(m for m in args.imports.split(",") if m), tuple(args.tree))
    return 0


if __name__ == "__main__":
    sys.exit(main())
