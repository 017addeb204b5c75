"""Warm spare trainers (megatron_ft.spares): a real pool process forks trainers for real worker
processes, which stand in for them - environment, arguments, working directory and standard
streams handed over, exit status and signals mirrored, nothing left behind."""
import os
import signal
import subprocess
import sys

import psutil
import pytest

from megatron_ft.spares import pool
from megatron_ft.testing.helpers import wait_for

SCRIPT = """
import atexit, os, sys, threading, time
import json as already_imported  # the pool imported it
import psutil
print("trainer", os.getpid(), os.getppid(), psutil.Process(os.getppid()).ppid(), os.environ.get("SPARE_TEST"),
      sys.argv[1:], os.getcwd(), flush=True)
atexit.register(lambda: print("atexit handler ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("non-daemon thread done", flush=True))).start()
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "sleep":
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def warm_pool(tmp_path):
    sock = str(tmp_path / "spares.sock")
    proc = pool.start(sock, str(tmp_path / "spares.log"), ("json",))
    assert pool.wait_warm(proc, sock, 60) is None, open(tmp_path / "spares.log").read()
    yield sock, proc
    pool.stop(proc, sock)
    assert not os.path.exists(sock)


def worker(tmp_path, sock, *args, **kw):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, SPARE_TEST="handed-over")
    if sock:
        env["MFT_SPARES_SOCKET"] = sock
    return subprocess.Popen([sys.executable, "-m", "megatron_ft.spares.worker", str(script), *args], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_a_trainer_from_the_pool_is_the_worker_in_everything_but_its_pid(tmp_path, warm_pool):
    sock, proc = warm_pool
    w = worker(tmp_path, sock, "3")
    out, err = w.communicate(timeout=60)
    assert w.returncode == 3, err
    first, *rest = out.splitlines()
    _, pid, parent, grandparent, env, argv, cwd = first.split(maxsplit=6)
    assert (env, argv.strip(), cwd.strip()) == ("handed-over", "['3']", str(tmp_path)), out
    # it ends as a cold interpreter would: non-daemon threads joined, then the atexit handlers
    assert rest == ["non-daemon thread done", "atexit handler ran"], out
    assert "to stderr" in err
    # forked from the pool, not the worker exec'ing a cold interpreter: its parent (seen by the trainer
    # itself while it ran) is the keeper the pool forked for this worker, the keeper's parent the pool
    pid, parent, grandparent = int(pid), int(parent), int(grandparent)
    assert pid != w.pid and parent not in (w.pid, proc.pid) and grandparent == proc.pid, (first, w.pid, proc.pid)
    # nothing left behind: the trainer and its keeper end with it (the pool itself stays)
    wait_for("the trainer and its keeper to end", lambda: not {pid, parent} & {
        c.pid for c in psutil.Process(proc.pid).children(recursive=True)}, 10)
    assert proc.poll() is None


def test_a_killed_trainer_ends_its_worker_by_the_same_signal(tmp_path, warm_pool):
    sock, _ = warm_pool
    pid_file = tmp_path / "pid"
    w = worker(tmp_path, sock, "sleep", str(pid_file))
    wait_for("the trainer to start", lambda: pid_file.exists() and pid_file.read_text(), 60)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    w.communicate(timeout=30)
    assert w.returncode == -signal.SIGKILL


def test_signals_reach_the_trainer_and_a_killed_worker_takes_its_trainer_along(tmp_path, warm_pool):
    sock, _ = warm_pool
    pid_file = tmp_path / "pid"
    w = worker(tmp_path, sock, "sleep", str(pid_file))
    wait_for("the trainer to start", lambda: pid_file.exists() and pid_file.read_text(), 60)
    w.send_signal(signal.SIGTERM)  # torchrun stopping its workers
    w.communicate(timeout=30)
    assert w.returncode == -signal.SIGTERM
    pid_file.unlink()
    w = worker(tmp_path, sock, "sleep", str(pid_file))
    wait_for("the trainer to start", lambda: pid_file.exists() and pid_file.read_text(), 60)
    trainer = int(pid_file.read_text())
    w.kill()  # SIGKILL: nothing can be forwarded; the keeper sees the worker's connection close
    w.communicate(timeout=30)
    wait_for("the orphaned trainer to be killed", lambda: not psutil.pid_exists(trainer)
             or psutil.Process(trainer).status() == psutil.STATUS_ZOMBIE, 10)


def test_without_a_pool_the_worker_runs_the_script_itself(tmp_path):
    w = worker(tmp_path, str(tmp_path / "no-such.sock"), "4")
    out, _ = w.communicate(timeout=120)
    assert w.returncode == 4 and int(out.split()[1]) == w.pid  # exec: the worker became the trainer


def test_a_stopped_pool_takes_its_trainers_along(tmp_path):
    sock = str(tmp_path / "spares.sock")
    proc = pool.start(sock, str(tmp_path / "spares.log"), ("json",))
    assert pool.wait_warm(proc, sock, 60) is None
    pid_file = tmp_path / "pid"
    w = worker(tmp_path, sock, "sleep", str(pid_file))
    wait_for("the trainer to start", lambda: pid_file.exists() and pid_file.read_text(), 60)
    trainer = int(pid_file.read_text())
    pool.stop(proc, sock)
    w.communicate(timeout=30)  # a bound on the wait, not a performance check
    assert w.returncode != 0
    wait_for("the trainer to die with its pool", lambda: not psutil.pid_exists(trainer)
             or psutil.Process(trainer).status() == psutil.STATUS_ZOMBIE, 10)


def test_the_pool_imports_what_the_training_script_imports(tmp_path):
    s = tmp_path / "ds.py"
    s.write_text("import deepspeed\nimport torch\n")
    assert "deepspeed" in pool.imports_for([str(s)]) and "megatron.core" not in pool.imports_for([str(s)])
    tree = tmp_path / "megatron-lm"  # upstream's tree brings its own megatron/: imported from there
    (tree / "megatron" / "core").mkdir(parents=True)
    (tree / "pretrain_gpt.py").write_text("from megatron.core import parallel_state\nimport torch\n"
                                          "from megatron.training import pretrain\nimport megatron.core.enums\n"
                                          "def f():\n    import megatron.legacy\n")
    wrapped = ["-m", "megatron_ft.testing.faults", "--fault", "x", "--", str(tree / "pretrain_gpt.py")]
    assert "megatron.core" in pool.imports_for(wrapped) and pool.own_trees(wrapped) == (str(tree),)
    # and every module of megatron the script names at its top level (not inside a function)
    named = pool.imports_for(wrapped)[-2:]
    assert named == ("megatron.training", "megatron.core.enums") and "megatron.legacy" not in pool.imports_for(wrapped)
    assert pool.own_trees([str(s)]) == ()
    assert "megatron.core" in pool.imports_for([os.path.join(os.path.dirname(__file__), "..", "..", "scripts",
                                                             "pretrain_gpt.py")])


def test_the_pool_imports_from_the_scripts_own_tree_before_the_installed_packages(tmp_path):
    """A package the script's tree provides is warmed from that tree (as the trainer would import
    it), and the trainer finds it already imported, from there."""
    tree = tmp_path / "tree"
    (tree / "mftprobe").mkdir(parents=True)
    (tree / "mftprobe" / "__init__.py").write_text("import os\nPID = os.getpid()\n")
    (tree / "train.py").write_text("import os, sys\nm = sys.modules.get('mftprobe')\n"
                                   "print(m and m.__file__, m and m.PID != os.getpid())\n")
    sock = str(tmp_path / "spares.sock")
    proc = pool.start(sock, str(tmp_path / "spares.log"), ("mftprobe",), (str(tree),))
    try:
        assert pool.wait_warm(proc, sock, 60) is None, open(tmp_path / "spares.log").read()
        w = subprocess.Popen([sys.executable, "-m", "megatron_ft.spares.worker", str(tree / "train.py")], cwd=tmp_path,
                             env=dict(os.environ, MFT_SPARES_SOCKET=sock), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err
        assert out.split() == [str(tree / "mftprobe" / "__init__.py"), "True"], (out, err)  # imported in the pool
    finally:
        pool.stop(proc, sock)


def test_what_the_pools_imports_did_per_process_runs_again_in_each_trainer(tmp_path):
    """A module imported in the pool registers what its import did per process; each trainer forked
    from the pool runs it with the worker's environment and arguments, before its script."""
    tree = tmp_path / "tree"
    (tree / "mftprobe").mkdir(parents=True)
    (tree / "mftprobe" / "__init__.py").write_text(
        "import os, sys\nfrom megatron_ft.spares import for_each_trainer\n"
        "def per_process():\n    os.environ['PROBE'] = f\"{os.getpid()} {os.environ.get('SPARE_TEST')} {sys.argv[1:]}\"\n"
        "per_process()\nfor_each_trainer(per_process)\n")
    (tree / "train.py").write_text("import os\nprint(os.getpid(), os.environ['PROBE'])\n")
    sock = str(tmp_path / "spares.sock")
    proc = pool.start(sock, str(tmp_path / "spares.log"), ("mftprobe",), (str(tree),))
    try:
        assert pool.wait_warm(proc, sock, 60) is None, open(tmp_path / "spares.log").read()
        for arg in ("first", "second"):
            w = subprocess.Popen([sys.executable, "-m", "megatron_ft.spares.worker", str(tree / "train.py"), arg],
                                 cwd=tmp_path, env=dict(os.environ, MFT_SPARES_SOCKET=sock, SPARE_TEST=arg),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = w.communicate(timeout=60)
            assert w.returncode == 0, err
            pid, hook_pid, env, argv = out.split(maxsplit=3)
            assert (hook_pid, env, argv.strip()) == (pid, arg, f"['{arg}']"), out
    finally:
        pool.stop(proc, sock)


def test_a_prestarted_process_runs_its_module_as_handed_over_or_ends_with_its_input(tmp_path):
    """``spares.prestart``: imports done ahead; the hand-over line gives the arguments, the whole
    environment and the log; the end of input without one ends it, having run nothing."""
    from megatron_ft.spares import prestart as ps
    from megatron_ft.spares.prestart import hand_over
    from megatron_ft.spares.prestart import start as prestart

    (tmp_path / "probe_mod.py").write_text("import os, sys\nprint('ran', sys.argv[1:], os.environ.get('PROBE'), "
                                           "os.environ.get('ONLY_BEFORE'))\nsys.exit(int(sys.argv[1]))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               ONLY_BEFORE="x")
    unused = prestart("probe_mod", ("json",), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    unused.stdin.close()
    assert unused.wait(timeout=60) == 0 and b"ran" not in unused.stdout.read()

    bad = prestart("probe_mod", (), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    bad.stdin.write(b'{"format": "something-else"}\n')
    bad.stdin.close()
    assert bad.wait(timeout=60) != 0 and ps.FORMAT.encode() in bad.stdout.read()

    log = tmp_path / "probe.log"
    good = prestart("probe_mod", ("json",), env=env)
    assert hand_over(good, ["3", "b"], env={"PROBE": "handed", "PYTHONPATH": str(tmp_path)}, log=str(log))
    assert good.wait(timeout=60) == 3
    text = log.read_text()
    assert "ran ['3', 'b'] handed None" in text and "probe_mod: pre-started" in text, text


ROUNDS_SCRIPT = """
import os, sys, datetime
from torch.distributed import TCPStore
rnd = int(os.environ.get("MFT_FAST_ROUND", "0"))
store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                 timeout=datetime.timedelta(seconds=20))  # hosted by the keeper, never by this trainer
store.set(f"trainer/{rnd}", str(os.getpid()))
print("round", rnd, os.environ["TORCHELASTIC_USE_AGENT_STORE"], os.environ.get("MFT_FRESH_STORE"), flush=True)
sys.exit(int(sys.argv[1]) if rnd < int(sys.argv[2]) else 0)
"""


def rounds_worker(tmp_path, sock, code, fail_rounds, budget):
    from megatron_ft.testing.helpers import free_port

    script = tmp_path / "rounds.py"
    script.write_text(ROUNDS_SCRIPT)
    env = dict(os.environ, MFT_SPARES_SOCKET=sock, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), TORCHELASTIC_USE_AGENT_STORE="False", MFT_FAST_RESTARTS=str(budget))
    env.pop("MFT_CONFIG", None)
    w = subprocess.Popen([sys.executable, "-m", "megatron_ft.spares.worker", str(script), str(code), str(fail_rounds)],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = w.communicate(timeout=120)
    return w.returncode, [ln.split() for ln in out.splitlines() if ln.startswith("round")], err


def test_a_failed_trainer_is_replaced_in_a_fast_round_beneath_its_worker(tmp_path, warm_pool):
    """Real keeper, real stores: the trainer of round 0 crashes twice over; the keeper of (torchrun's)
    rank 0 hosts the job store, opens rounds 1 and 2, hosts their stores, forks new trainers, and the
    worker - what torchrun watches - sees only the final success."""
    rc, rounds, err = rounds_worker(tmp_path, warm_pool[0], code=7, fail_rounds=2, budget=3)
    assert rc == 0, err
    assert rounds == [["round", "0", "True", "1"], ["round", "1", "True", "1"], ["round", "2", "True", "1"]], rounds


@pytest.mark.slow  # 27 s of real rounds (default-suite time); the budget's rule: tests/unit/test_fast_restart.py
def test_fast_rounds_end_at_the_budget_and_never_retry_an_end_of_the_job(tmp_path, warm_pool):
    rc, rounds, err = rounds_worker(tmp_path, warm_pool[0], code=7, fail_rounds=9, budget=2)
    assert rc == 7 and [r[1] for r in rounds] == ["0", "1", "2"], (rc, rounds, err)  # then torchrun's turn
    rc, rounds, err = rounds_worker(tmp_path, warm_pool[0], code=2, fail_rounds=9, budget=2)
    assert rc == 2 and [r[1] for r in rounds] == ["0"], (rc, rounds, err)  # megatron_ft.fatal's code: no retry


@pytest.mark.slow  # 20 s of real rounds (default-suite time); the watcher itself: tests/integration/test_node_watch.py
def test_a_node_watcher_that_died_is_started_again_for_the_next_keepers(tmp_path, warm_pool):
    from megatron_ft.spares.node_watch import WATCH_PROCESS_NAME

    sock, proc = warm_pool
    rc, rounds, err = rounds_worker(tmp_path, sock, code=7, fail_rounds=1, budget=2)
    assert rc == 0 and [r[1] for r in rounds] == ["0", "1"], (rc, rounds, err)
    (watcher,) = [c for c in psutil.Process(proc.pid).children() if c.name() == WATCH_PROCESS_NAME]
    watcher.kill()
    watcher.wait(10)
    rc, rounds, err = rounds_worker(tmp_path, sock, code=7, fail_rounds=1, budget=2)
    assert rc == 0 and [r[1] for r in rounds] == ["0", "1"], (rc, rounds, err)
    assert [c.name() for c in psutil.Process(proc.pid).children()].count(WATCH_PROCESS_NAME) == 1
