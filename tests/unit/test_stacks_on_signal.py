"""A stuck trainer says where it is: SIGUSR1 writes every thread's stack to its stderr, then ends it as
SIGUSR1 did before (megatron_ft/health/progress.py ``stacks_on_sigusr1``, installed with the trainer's
progress record; the demo sends it to every process of a job that outlived its bound)."""
import signal
import subprocess
import sys

from conftest import REPO

STUCK = f'''
import sys, time
sys.path.insert(0, {REPO!r})
from megatron_ft.health.progress import stacks_on_sigusr1
stacks_on_sigusr1()
print("ready", flush=True)
def waiting_for_a_peer():
    time.sleep(60)
waiting_for_a_peer()
'''


def test_sigusr1_writes_the_stacks_then_ends_the_process():
    p = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGUSR1)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == -signal.SIGUSR1
    assert "in waiting_for_a_peer" in err and "most recent call first" in err, err
