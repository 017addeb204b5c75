"""In-process restart, the trainer's side (megatron_ft/trainer/in_process.py), with real sockets and
threads: the keeper's end of the control socket is played by the test."""
import os
import socket
import threading

import pytest

from megatron_ft.spares.messages import FROM_TRAINER
from megatron_ft.trainer import in_process
from megatron_ft.transport import wire


@pytest.fixture
def keeper(monkeypatch):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    monkeypatch.setenv(in_process.ENV_FD, str(theirs.detach()))
    monkeypatch.setenv("MFT_FAST_ROUND", "0")
    monkeypatch.setenv("MASTER_PORT", "1000")
    ours.settimeout(10)
    yield ours
    ours.close()


def recv(sock):
    """The trainer's next message to its keeper, typed (megatron_ft/spares/messages.py)."""
    return wire.recv_packet(sock, FROM_TRAINER)[0]


def with_keeper(play, run):
    """``run()`` here while ``play()`` plays the keeper's side in a thread; an assertion that fails
    on the keeper's side fails the test."""
    errors = []

    def target():
        try:
            play()
        except BaseException as e:  # noqa: B902 - re-raised below, in the test's thread
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    try:
        return run()
    finally:
        t.join(10)
        assert not t.is_alive(), "the keeper's side did not finish"
        if errors:
            raise errors[0]


def test_a_failed_attempt_rejoins_the_round_the_keeper_opens(keeper):
    seen = []

    def train(number):
        seen.append((number, os.environ["MASTER_PORT"], os.environ["MFT_FAST_ROUND"], in_process.attempt()[0]))
        if number == 0:
            raise RuntimeError("Connection closed by peer")
        return 7

    def play_keeper():
        assert recv(keeper).op == "rejoinable"
        assert recv(keeper).reason.startswith("RuntimeError: Connection closed by peer")
        wire.send_packet(keeper, {"op": "round", "round": 1, "port": 2345})
        assert recv(keeper).round == 1

    assert with_keeper(play_keeper, lambda: in_process.run(train)) == 7
    assert seen == [(0, "1000", "0", 0), (1, "2345", "1", 1)]
    assert in_process.ENV_FD not in os.environ  # not inherited by the training script's children


def test_the_failure_ends_the_process_when_the_keeper_says_exit(keeper):
    def train(number):
        raise ValueError(f"attempt {number}")

    def play_keeper():
        recv(keeper), recv(keeper)
        wire.send_packet(keeper, {"op": "exit"})

    with pytest.raises(ValueError, match="attempt 0"):
        with_keeper(play_keeper, lambda: in_process.run(train))


def test_a_clean_exit_is_never_restarted(keeper):
    def train(number):
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        in_process.run(train)
    assert recv(keeper).op == "rejoinable"
    keeper.setblocking(False)  # run() sends on its own thread before it returns: nothing more was sent
    with pytest.raises(BlockingIOError):  # no "failed": SystemExit is not a failure to restart from
        keeper.recv(4096)


def test_without_a_keeper_it_is_one_plain_attempt(monkeypatch):
    monkeypatch.delenv(in_process.ENV_FD, raising=False)
    assert in_process.run(lambda number: number + 5) == 5


def test_a_round_message_aborts_the_rounds_connections_so_a_blocked_receive_ends(keeper, monkeypatch):
    """A collective blocked on a peer is a blocked socket read: the round's message shuts it down;
    connections from before the round and listening sockets stay."""
    server = socket.create_server(("127.0.0.1", 0))
    before = socket.create_connection(server.getsockname())
    before_peer, _ = server.accept()
    monkeypatch.setattr(in_process, "_ROUND_SOCKETS", None)
    in_process.mark_round_start()
    during = socket.create_connection(server.getsockname())
    during_peer, _ = server.accept()
    got = []
    reader = threading.Thread(target=lambda: got.append(during.recv(10)))
    reader.start()

    def train(number):
        if number == 0:
            reader.join(10)  # blocked until the round's message arrives
            raise RuntimeError("collective failed")
        return 0

    def play_keeper():
        recv(keeper)
        wire.send_packet(keeper, {"op": "round", "round": 1, "port": 9})
        assert recv(keeper).round == 1

    assert with_keeper(play_keeper, lambda: in_process.run(train)) == 0
    assert got == [b""] and not reader.is_alive()  # the read ended: shut down
    before.sendall(b"x")  # a connection from before the round still works
    assert before_peer.recv(1) == b"x"
    server.getsockname()  # the listener is still open
    c = socket.create_connection(server.getsockname())
    c.close()
    for s in (server, before, before_peer, during, during_peer):
        s.close()


def test_abort_before_any_round_touches_nothing(monkeypatch):
    monkeypatch.setattr(in_process, "_ROUND_SOCKETS", None)
    assert in_process.abort_round_connections() == 0


def test_weights_are_built_uninitialised_only_in_a_later_attempt_whose_agent_holds_a_version(keeper):
    """Attempt 0 always initialises (the holder is not even asked); attempt 1 with a version held
    builds uninitialised, and restoring nothing then ends the process: NothingRestored is never
    restarted in place (a fresh process, which initialises, takes its place)."""
    asked, decided = [], []

    def holds():
        asked.append(in_process.attempt()[0])
        return True

    def train(number):
        decided.append(in_process.build_uninitialised(holds))
        if number == 0:
            in_process.check_restored(False)  # initialised weights: a fresh start is fine
            raise RuntimeError("Connection closed by peer")
        in_process.check_restored(False)

    def play_keeper():
        recv(keeper), recv(keeper)
        wire.send_packet(keeper, {"op": "round", "round": 1, "port": 2345})
        assert recv(keeper).round == 1

    with pytest.raises(in_process.NothingRestored, match="attempt 1 built its model without initialising"):
        with_keeper(play_keeper, lambda: in_process.run(train))
    assert (decided, asked) == ([False, True], [1])
    keeper.setblocking(False)  # no "failed" for it: the process ends, its keeper re-forks the rank
    with pytest.raises(BlockingIOError):
        keeper.recv(4096)


def test_a_later_attempt_initialises_when_its_agent_holds_nothing(keeper):
    def train(number):
        if number == 0:
            raise RuntimeError("Connection closed by peer")
        assert not in_process.build_uninitialised(lambda: False)
        in_process.check_restored(False)  # initialised: starting fresh is allowed
        return 4

    def play_keeper():
        recv(keeper), recv(keeper)
        wire.send_packet(keeper, {"op": "round", "round": 1, "port": 2345})
        recv(keeper)

    assert with_keeper(play_keeper, lambda: in_process.run(train)) == 4
