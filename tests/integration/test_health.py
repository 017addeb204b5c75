"""The agents' health store and monitor: the embedded store (on the wire) and a real etcd server
(the ``etcd`` binary of Debian's etcd-server, started here on free loopback ports; one over TLS with
client certificates), root election
and re-election after the root agent's process is SIGKILLed, heartbeat failure verdicts, standby
claims, and a node (the root's too) lost and rebuilt from its peers bit for bit."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest

from megatron_ft import config as ftconfig
from megatron_ft.testing import helpers
from megatron_ft.testing.helpers import free_port
from megatron_ft.health.monitor import claim_key
from megatron_ft.health.store import StoreClient, StoreUnavailable
from megatron_ft.launch import claim_failed_node
from megatron_ft.testing.sim import LocalCluster

from test_peer_redundancy import assert_same, make_model

ETCD = shutil.which("etcd")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A one-member etcd cluster on loopback; yields its ``etcd://127.0.0.1:PORT``."""
    if ETCD is None:
        pytest.skip("no etcd binary on PATH (Debian: apt-get install etcd-server; scripts/setup.sh does it as root)")
    pytest.importorskip("etcd3gw", reason="the etcd3gw client is not installed (pip install -e '.[etcd]')")
    d = tmp_path_factory.mktemp("etcd")
    with running_etcd(d) as url:
        yield url


@contextlib.contextmanager
def running_etcd(d, tls=None, server_args=()):
    """A one-member etcd with its data and log in ``d``, healthy (``tls``: the client's
    :class:`~megatron_ft.health.etcd.EtcdTLS`, and etcd serves HTTPS with ``server_args``); yields its
    ``etcd://127.0.0.1:PORT`` and stops it."""
    from megatron_ft.health.etcd import EtcdKV

    client, peer = free_port(), free_port()
    scheme = "https" if tls else "http"
    log = open(d / "etcd.log", "wb")
    proc = subprocess.Popen([ETCD, "--name", "t", "--data-dir", str(d / "data"),
                             "--listen-client-urls", f"{scheme}://127.0.0.1:{client}",
                             "--advertise-client-urls", f"{scheme}://127.0.0.1:{client}", *server_args,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"etcd://127.0.0.1:{client}"
    try:
        try:
            EtcdKV(url, "probe/", tls=tls).wait_ready(30)
        except StoreUnavailable:
            pytest.fail(f"etcd did not become healthy:\n{(d / 'etcd.log').read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _openssl(*args, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(d, name: str = "ca") -> dict:
    """A CA (``name``), a server certificate for 127.0.0.1 and a client certificate it signed (openssl)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)
    out = {"ca": str(d / f"{name}.pem")}
    for who, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"),
                     ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{who}.ext").write_text(ext)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", f"{name}-{who}.key",
                 "-out", f"{name}-{who}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}-{who}.csr", "-CA", f"{name}.pem", "-CAkey", f"{name}.key",
                 "-CAcreateserial", "-days", "2", "-extfile", f"{who}.ext", "-out", f"{name}-{who}.pem", cwd=d)
        out[who] = (str(d / f"{name}-{who}.pem"), str(d / f"{name}-{who}.key"))
    return out


@pytest.fixture(scope="module")
def etcd_tls(tmp_path_factory):
    """A one-member etcd that speaks only TLS and asks every client for a certificate its CA signed
    (``--client-cert-auth``); yields (``etcd://127.0.0.1:PORT``, its certificates, another CA's)."""
    if ETCD is None or shutil.which("openssl") is None:
        why = "no etcd or openssl binary on PATH (scripts/setup.sh installs both as root)"
        if os.environ.get("CI") == "true":  # CI must test etcd over TLS, not skip it
            pytest.fail(f"the etcd-over-TLS test skipped under CI=true: {why}")
        pytest.skip(why)
    pytest.importorskip("etcd3gw", reason="the etcd3gw client is not installed (pip install -e '.[etcd]')")
    d = tmp_path_factory.mktemp("etcd-tls")
    certs, stranger = make_certificates(d), make_certificates(d, "other")
    from megatron_ft.health.etcd import EtcdTLS

    with running_etcd(d, EtcdTLS(certs["ca"], *certs["client"]),
                      ("--cert-file", certs["server"][0], "--key-file", certs["server"][1],
                       "--client-cert-auth", "--trusted-ca-file", certs["ca"])) as url:
        yield url, certs, stranger


def test_etcd_over_tls_serves_a_client_certificate_of_its_ca_and_refuses_others(etcd_tls, tmp_path):
    """health.etcd_ca_file / etcd_cert_file / etcd_key_file: the store client of a configuration speaks
    HTTPS with its certificate and is served; plain HTTP, no client certificate, or one of another CA is
    refused with the endpoint named."""
    from megatron_ft.health.etcd import EtcdKV, EtcdTLS

    url, certs, other = etcd_tls
    cfg = ftconfig.replace(ftconfig.load(), run_id=f"t{uuid.uuid4().hex[:8]}",
                           health={"store": url, "etcd_ca_file": certs["ca"], "etcd_cert_file": certs["client"][0],
                                   "etcd_key_file": certs["client"][1]})
    client = StoreClient(cfg).connect(10)
    assert client.compare_set("root", "", "0") == "0" and client.get("root") == "0"
    for tls in (None, EtcdTLS(certs["ca"]), EtcdTLS(certs["ca"], *other["client"])):
        kv = EtcdKV(url, f"mft/{cfg.run_id}/", 2.0, tls)
        with pytest.raises(StoreUnavailable, match=r"etcd at 127\.0\.0\.1:\d+"):
            kv.get("root")
    with pytest.raises(StoreUnavailable, match="health.etcd_ca_file='/nope.pem': no such file"):
        EtcdKV(url, "x/", 2.0, EtcdTLS("/nope.pem"))
    with pytest.raises(ftconfig.ConfigError, match="health.etcd_cert_file=.* needs its pair"):
        ftconfig.replace(cfg, health={"etcd_key_file": ""})
    with pytest.raises(ftconfig.ConfigError, match="health.etcd_ca_file=.* is for an etcd store"):
        ftconfig.replace(ftconfig.load(), health={"etcd_ca_file": certs["ca"]})


def etcd_store(url, node, nodes=3, run_id=None):
    from megatron_ft.health.etcd import EtcdStore

    return EtcdStore(url, run_id or f"t{uuid.uuid4().hex[:8]}", node, nodes, timeout_s=2.0)


# ---------------------------------------------------------------- etcd store API


def test_etcd_kv_set_get_delete_compare_set(etcd):
    from megatron_ft.health.etcd import EtcdKV

    kv = EtcdKV(etcd, f"mft/{uuid.uuid4().hex[:8]}/")
    assert kv.get("a") is None
    kv.set("a", "1")
    assert kv.get("a") == "1"
    assert kv.compare_set("a", "2", "3") == "1"  # mismatch: unchanged, current value returned
    assert kv.compare_set("a", "1", "3") == "3" and kv.get("a") == "3"
    assert kv.compare_set("b", "", "x") == "x"  # "" = create if absent
    assert kv.compare_set("b", "", "y") == "x"  # exists: not overwritten
    assert kv.compare_set("c", "z", "w") == "" and kv.get("c") is None  # absent and expected a value
    kv.set("u", "µ-π json {\"k\": 1}")
    assert kv.get("u") == "µ-π json {\"k\": 1}"
    kv.delete("a")
    assert kv.get("a") is None
    other = EtcdKV(etcd, f"mft/{uuid.uuid4().hex[:8]}/")  # keys are per prefix (run)
    assert other.get("b") is None


def test_etcd_unreachable_error_names_the_endpoint():
    pytest.importorskip("etcd3gw")
    port = free_port()  # nothing listens there
    store = etcd_store(f"etcd://127.0.0.1:{port}", 0)
    raised = []

    def connect():
        with pytest.raises(StoreUnavailable, match=rf"etcd at 127\.0\.0\.1:{port} \(etcd://127\.0\.0\.1:{port}\).*"
                                                    r"still unreachable after 0\.5 s"):
            store.connect(0.5)
        raised.append(True)

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # a wait limit (connect must honour its deadline and give up), not a performance check
        pytest.fail("EtcdStore.connect(0.5) did not give up")
    assert raised == [True]


def test_bad_etcd_endpoint_is_rejected_with_the_value():
    from megatron_ft.health.etcd import parse_endpoint

    with pytest.raises(ftconfig.ConfigError, match="health.store.*etcd:/h:1.*'embedded' or 'etcd://HOST:PORT'"):
        ftconfig.replace(ftconfig.load(), health={"store": "etcd:/h:1"})
    with pytest.raises(ValueError, match="'etcd://h:99999' is invalid.*port 1-65535"):
        parse_endpoint("etcd://h:99999")


def test_etcd_root_is_a_lease_bound_put_if_absent_and_the_lowest_live_node_takes_it(etcd):
    """``root`` is put-if-absent with the claimer's lease: the first to arrive holds it; when its lease
    lapses (its keepalive stopped, as a killed agent's) etcd deletes it, the others see that on their
    watch, and the lowest-numbered live node puts it; exactly one holds it at any time."""
    run = f"t{uuid.uuid4().hex[:8]}"
    stores = {n: etcd_store(etcd, n, 4, run) for n in (2, 0, 1, 3)}
    try:
        assert stores[2].connect(5) == 2  # the first to arrive is root, whatever its number
        assert [stores[n].connect(5) for n in (0, 1, 3)] == [2, 2, 2]
        assert [stores[n].is_root for n in range(4)] == [False, False, True, False]
        assert stores[2].kv.get("alive/000002") is not None  # the liveness key, on the same lease
        stores[2].close()  # no more keepalives: the lease (2 s) lapses
        wait_for("node 0 the root", lambda: stores[0].is_root, timeout=stores[0].ttl_s + 3)
        wait_for("every survivor following node 0", lambda: [stores[n].root for n in (0, 1, 3)] == [0, 0, 0],
                 timeout=3)
        assert stores[0].get("root") == "0" and not stores[1].is_root and not stores[3].is_root
        assert stores[0].get("alive/000002") is None
    finally:
        for s in stores.values():
            s.close()


# ---------------------------------------------------------------- real agents: election, verdicts, rebuild

FAST_HEALTH = {"heartbeat_s": 0.1, "timeout_s": 1.0}


def wait_for(what, fn, timeout=30.0, cluster=None):
    logs = (lambda: cluster.logs(tail=6000)) if cluster else (lambda: "")
    return helpers.wait_for(what, fn, timeout, logs)


def verdict(client, n):
    v = client.get(f"failed/{n}")
    return json.loads(v) if v is not None else None


def verdict_when_readable(client, n):
    """For polling until a verdict comes: a read while the root moves may fail (the lost root's store,
    or the new root's still starting), which is no news, as for the product's own readers (``launch``'s
    verdict watch); the caller polls again. (A check that there is *no* verdict reads strictly.)"""
    try:
        return verdict(client, n)
    except StoreUnavailable:
        return None


def heartbeat(client, n):
    """Node ``n``'s last heartbeat record, ``{}`` before its agent wrote the first one."""
    v = client.get(f"hb/{n}")
    return json.loads(v) if v is not None else {}


STORES = [pytest.param("embedded", "root", id="embedded-root-lost"),
          pytest.param("etcd", "root", id="etcd-root-lost", marks=pytest.mark.slow),  # embedded covers it by default
          pytest.param("etcd", "other", id="etcd-node-lost", marks=pytest.mark.slow)]


class Standbys:
    """Two standby claimers (megatron_ft.launch.claim_failed_node), each with its own StoreClient,
    polling the job's store in threads until one claims a failed node; the other times out."""

    def __init__(self, cfg, nodes, timeout_s):
        self.got, self.errors = {}, []
        self.threads = [threading.Thread(target=self._run, args=(cfg, nodes, f"spare{i}", timeout_s))
                        for i in range(2)]
        for t in self.threads:
            t.start()

    def _run(self, cfg, nodes, who, timeout_s):
        try:
            self.got[who] = claim_failed_node(StoreClient(cfg), nodes, who, poll_s=0.05, timeout_s=timeout_s,
                                              log=lambda m: None)
        except (TimeoutError, StoreUnavailable) as e:
            self.errors.append(str(e))

    def join(self):
        for t in self.threads:
            t.join()
        return self.got, self.errors


@pytest.mark.parametrize("kind,which", STORES)
def test_lost_node_gets_a_verdict_root_moves_and_node_is_rebuilt_from_peers(tmp_path, request, kind, which):
    """``which``: the root is lost, or another node. The embedded store's root is node 0's server;
    with etcd the first agent to arrive is root (the agents start side by side: any of them)."""
    health = dict(FAST_HEALTH, store=request.getfixturevalue("etcd")) if kind == "etcd" else FAST_HEALTH
    c = LocalCluster(str(tmp_path), 3, make_model, chunk_bytes=1 << 14, config={"health": health},
                     scheme="replica", replicas=2)
    try:
        client = StoreClient(c.cfg).connect(10)
        root = int(client.get("root"))
        assert kind == "etcd" or root == 0, root
        assert {c.status(n)["root"] for n in range(3)} == {root}
        lost = root if which == "root" else max(n for n in range(3) if n != root)
        c.train(2)
        standbys = Standbys(c.cfg, 3, timeout_s=20)
        time.sleep(0.5)
        assert not standbys.got  # nothing failed yet: both wait
        pid = c.agents[lost].proc.pid
        c.lose_node(lost)  # SIGKILL of the agent, its shared memory removed
        new_root = root if lost != root else min(n for n in range(3) if n != lost)  # the lowest live one
        v = wait_for(f"failed/{lost}", lambda: verdict_when_readable(client, lost), cluster=c)
        assert (v["node"], v["kind"], v["pid"], v["detected_by"]) == (lost, "hardware", pid, new_root)
        assert client.get("root") == str(new_root)
        # every survivor follows the new root (each notices on its own heartbeat, so allow it a moment)
        wait_for("survivors following the new root",
                 lambda: {c.status(n)["root"] for n in range(3) if n != lost} == {new_root}, cluster=c)
        # exactly one standby claims the node (with the embedded store: on the new root's server)
        who = wait_for("a standby's claim", lambda: client.get(claim_key(lost, v)), cluster=c)
        c.replace_node(lost)  # a fresh agent (new pid): the verdict is withdrawn, the root stays
        wait_for(f"failed/{lost} cleared", lambda: verdict(client, lost) is None, cluster=c)
        assert client.get("root") == str(new_root) and c.status(lost)["root"] == new_root
        res, model = c.restore(lost)
        assert (res.source, res.step) == ("peer_memory", 2), res.rejected
        assert_same(c.models[lost], model)
        c.train(1, start=3)  # the group protects new versions again under the new root
        assert {c.status(n)["redundancy"]["complete_step"] for n in range(3)} == {3}
        got, errors = standbys.join()
        assert list(got) == [who] and got[who][0] == lost and got[who][1]["pid"] == pid, (got, errors)
        assert len(errors) == 1 and "no failed node to take over within 20 s" in errors[0], errors
    finally:
        c.close()


def test_refused_connection_is_the_only_probe_answer_that_means_gone():
    import socket

    from megatron_ft.health.monitor import refuses_connections

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    assert not refuses_connections(f"127.0.0.1:{port}", 0.5)  # something listens: alive (or at least there)
    srv.close()
    assert refuses_connections(f"127.0.0.1:{port}", 0.5)  # nothing listens any more
    assert not refuses_connections("not-an-address", 0.2)


def _probe_cluster(tmp_path, timeout_s, heartbeat_s=0.1):
    return LocalCluster(str(tmp_path), 3, make_model, chunk_bytes=1 << 14, scheme="replica", replicas=2,
                        config={"health": {"heartbeat_s": heartbeat_s, "timeout_s": timeout_s}})


def _lose_node_and_see_the_probe_judge_it(c, client, node, limit_s):
    """Kill ``node``'s agent; the root (node 0) judges it by the probe - a refused connection - not by
    ``timeout_s``."""
    pid = c.agents[node].proc.pid
    c.lose_node(node)
    v = wait_for(f"failed/{node}", lambda: verdict_when_readable(client, node), timeout=limit_s, cluster=c)
    assert (v["pid"], v["detected_by"]) == (pid, 0) and v["why"].endswith("refuses connections"), v


def test_a_dead_agent_is_judged_by_the_probe_before_the_timeout(tmp_path):
    """The root probes a node whose heartbeats stopped: a refused connection (the agent process is
    gone, its host answers) is a verdict long before ``timeout_s`` (30 s here)."""
    c = _probe_cluster(tmp_path, 30.0)
    try:
        client = StoreClient(c.cfg).connect(10)
        c.train(1)
        _lose_node_and_see_the_probe_judge_it(c, client, 2, limit_s=25.0)
    finally:
        c.close()


def test_an_agent_lost_before_its_first_periodic_heartbeat_is_judged_too(tmp_path):
    """An agent writes its first heartbeat when it starts, not one period later: one that dies
    within its first period (3 s here) still leaves a heartbeat the root watches stop (without it,
    the root never judged the node, by the probe or by ``timeout_s``)."""
    c = _probe_cluster(tmp_path, 60.0, heartbeat_s=3.0)
    try:
        client = StoreClient(c.cfg).connect(10)
        assert heartbeat(client, 2).get("pid") == c.agents[2].proc.pid  # written at start, not 3 s later
        _lose_node_and_see_the_probe_judge_it(c, client, 2, limit_s=40.0)
    finally:
        c.close()


def test_a_starting_job_is_told_from_a_running_one_by_trainers_not_by_heartbeat_counts(tmp_path):
    """A launcher that finds no rendezvous record waits for one only when the job was already
    running (a replacement). Agents that heartbeat for long before their trainers come (spare pools
    warming up, slow imports) are still a starting job; one whose trainers registered is running."""
    from megatron_ft.launch import Rendezvous

    c = _probe_cluster(tmp_path, 30.0)  # heartbeats every 0.1 s
    try:
        rdzv = Rendezvous(c.cfg, 2)
        rdzv.store.connect(10)
        wait_for("30 heartbeats of node 0", lambda: heartbeat(rdzv.store, 0).get("seq", 0) >= 30, cluster=c)
        assert not rdzv._job_running()  # long-lived agents, no trainer yet: starting
        c.train(1)
        wait_for("node 0's heartbeat after its trainer registered",
                 lambda: heartbeat(rdzv.store, 0).get("trained"), cluster=c)
        assert rdzv._job_running()
    finally:
        c.close()


def test_an_agent_writes_every_threads_stack_into_its_log_on_sigusr1(tmp_path):
    """Diagnosing a stuck agent live: ``kill -USR1 <agent pid>`` (faulthandler); the agent goes on."""
    c = _probe_cluster(tmp_path, 30.0)
    try:
        c.train(1)
        c.agents[0].dump_threads()
        # every thread's stack, the heartbeat thread's among them (the dump is written while we read)
        wait_for("a stack dump with the heartbeat thread", lambda: "most recent call first" in c.agents[0].log()
                 and "health/monitor.py" in c.agents[0].log(), timeout=10.0, cluster=c)
        c.train(1, start=2)  # still serving
        assert c.status(0)["redundancy"]["complete_step"] == 2
    finally:
        c.close()


def test_a_stalled_agent_is_judged_only_after_the_timeout(tmp_path):
    """An agent that is alive but stalls (SIGSTOP: the kernel still accepts its connections) gets no
    verdict from the probe, only after ``timeout_s``, as before the probe."""
    import signal

    c = _probe_cluster(tmp_path, 4.0)
    stopped = None
    try:
        client = StoreClient(c.cfg).connect(10)
        c.train(1)
        stopped = c.agents[1].proc.pid
        os.kill(stopped, signal.SIGSTOP)
        v = wait_for("failed/1 after the timeout", lambda: verdict_when_readable(client, 1), cluster=c)
        # probed every heartbeat period while stopped, always accepted: the verdict is the timeout's,
        # and the age it gives (the root's own clock) is past timeout_s - no verdict came before it
        assert "refuses" not in v["why"] and v["why"].startswith("missed heartbeats for"), v
        assert float(v["why"].split()[3]) >= c.cfg.health.timeout_s, v  # printed to 0.1 s
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        c.close()


def test_a_root_that_was_not_running_judges_no_one_for_its_own_silence(tmp_path):
    """The root's monitor looks at the others' heartbeats every ``heartbeat_s``; when its process did not
    run for longer than ``timeout_s`` (an overloaded host, a paused process), the heartbeats written
    meanwhile could not be read: their silence is its own, not the other node's. Real embedded stores
    (node 0 the root, node 1 following it), the monitor's clock driven by the test: after a 3 s gap (2 s
    timeout) no verdict; then, a node that stays silent while the root watches is judged once its
    silence passes the timeout as before."""
    from megatron_ft.health.monitor import Monitor
    from megatron_ft.health.store import EmbeddedStore

    run, port = f"t{uuid.uuid4().hex[:8]}", free_port()
    root = EmbeddedStore(run, 0, 2, [], port, timeout_s=2.0)
    other = EmbeddedStore(run, 1, 2, [], port, timeout_s=2.0)
    try:
        assert root.connect(10) == 0 and other.connect(10) == 0
        now = [100.0]
        m = Monitor(root, 0, 2, heartbeat_s=0.1, timeout_s=2.0, clock=lambda: now[0])
        seq = [0]

        def node1_beats():
            seq[0] += 1
            other.set("hb/1", json.dumps({"pid": 4242, "seq": seq[0], "time": time.time(), "launcher": 0,
                                         "addr": "", "trained": True}))

        def looks(n, beating):  # n heartbeat periods on the root's clock
            for _ in range(n):
                if beating:
                    node1_beats()
                now[0] += 0.1
                m.beat()

        looks(5, beating=True)
        now[0] += 3.0  # the root's process did not run; node 1's beats of that time were never read
        looks(1, beating=False)
        assert verdict(root, 1) is None and not m.failed
        looks(5, beating=True)
        assert verdict(root, 1) is None
        looks(15, beating=False)  # 1.5 s of watched silence: below the timeout
        assert verdict(root, 1) is None
        looks(10, beating=False)  # 2.5 s: judged
        v = verdict(root, 1)
        assert v is not None and v["why"].startswith("missed heartbeats for"), v
    finally:
        other.close()
        root.close()


def test_standby_flag_rejects_node_rank(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatron_ft.cli", "launch", "--standby", "--node-rank=1", "--nodes=2",
                        f"--run-dir={tmp_path}", "--", "x.py"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ))
    assert r.returncode != 0
    assert "--node-rank=1 is invalid with --standby" in r.stderr + r.stdout


def test_the_root_serves_itself_in_process_and_a_follower_without_a_root_gets_one_clear_error(monkeypatch):
    """The root's calls go to its own map in process: becoming root opens no connection to its own server
    (a connection that timed out on a loaded machine once made an agent exit at start-up and end the
    job), and its reads are counted apart from the wire's. A follower whose root never answers asks
    again until its deadline, then fails with one clear error."""
    from megatron_ft.health import store as st

    port = free_port()
    s = st.EmbeddedStore(f"t{uuid.uuid4().hex[:8]}", 0, 2, [], port, timeout_s=2.0)
    real, calls = st.WireKV, []

    def counted(host, p, prefix, timeout_s, secret):
        calls.append((host, p))
        return real(host, p, prefix, timeout_s, secret)

    monkeypatch.setattr(st, "WireKV", counted)
    try:
        assert s.connect(deadline_s=10) == 0
        assert ("127.0.0.1", port) not in calls and s.get("root") == "0"
        s.set("hb/0", json.dumps({"pid": 1, "launcher": 2}))
        ops = s._server.op_counts()
        assert ops.get("local get", 0) >= 1 and ops.get("local set", 0) >= 2 and ops.get("get", 0) == 0, ops
        monkeypatch.setattr(st, "WireKV", lambda *a: (_ for _ in ()).throw(StoreUnavailable("store at x: down")))
        follower = st.EmbeddedStore(f"t{uuid.uuid4().hex[:8]}", 1, 2, [], free_port() - 1, timeout_s=2.0)
        try:
            with pytest.raises(StoreUnavailable, match=r"node 1: no root agent within 0.5 s"):
                follower.connect(deadline_s=0.5)
        finally:
            follower.close()
    finally:
        s.close()


OLD_ROOT = """
import sys, time
from megatron_ft.health.store import EmbeddedStore
s = EmbeddedStore(sys.argv[1], 0, 2, [], int(sys.argv[2]), timeout_s=2.0)
assert s.connect(deadline_s=10) == 0
print("root", flush=True)
time.sleep(600)
"""


def test_a_client_of_a_lost_root_finds_the_new_root_not_the_replacement_on_its_address(tmp_path):
    """Node 0's agent (the store's root) is SIGKILLed; node 1 becomes root; a replacement agent of node 0
    serves a store of its own on the lost root's address and follows node 1. A client that was connected
    to the lost root (a launcher's) must find node 1's store - not re-open its connection to the same
    address and read the replacement's empty map (in a chaos trial, a launcher waited out its deadline
    for a verdict it was reading from the wrong store and ended the job)."""
    from megatron_ft.health.store import EmbeddedStore

    run, port = f"t{uuid.uuid4().hex[:8]}", helpers.free_port_range(2)
    cfg = ftconfig.replace(ftconfig.load(), run_id=run, cluster={"nodes": 2},
                           health={"store_port": port, "timeout_s": 2.0, "heartbeat_s": 0.1})
    old = subprocess.Popen([sys.executable, "-c", OLD_ROOT, run, str(port)], stdout=subprocess.PIPE, text=True)
    stores = []
    try:
        assert old.stdout.readline().strip() == "root"
        s1 = EmbeddedStore(run, 1, 2, [], port, timeout_s=2.0)
        stores.append(s1)
        assert s1.connect(deadline_s=10) == 0
        client = StoreClient(cfg).connect(10)
        assert client.root == 0 and client.get("failed/0") is None
        old.kill()
        old.wait(timeout=10)
        assert s1.failover() == 1
        s1.set("failed/0", "the verdict")
        replacement = EmbeddedStore(run, 0, 2, [], port, timeout_s=2.0)  # the lost root's address again
        stores.append(replacement)
        assert replacement.connect(deadline_s=10) == 1
        assert client.get("failed/0") == "the verdict" and client.root == 1
    finally:
        old.kill()
        old.wait(timeout=10)
        for s in stores:
            s.close()
