"""Where the job's secret comes from: the launcher names it in every node's configuration whenever the
agents serve anything over TCP (the store of a job of several nodes, the peer transport), generates one
for a job of one machine, and refuses a job of hosts of their own without one, before anything starts."""
from __future__ import annotations

import os
import threading

import pytest

from megatron_ft import config as ftconfig
from megatron_ft.launch import with_job_secret
from megatron_ft.transport import credential


def test_a_job_of_several_nodes_gets_a_secret_whatever_its_scheme(tmp_path, monkeypatch):
    monkeypatch.delenv(credential.ENV, raising=False)
    one = ftconfig.replace(ftconfig.load(), cluster={"nodes": 1}, redundancy={"scheme": "none"})
    assert with_job_secret(one, str(tmp_path)).security.secret_file == ""  # nothing served over TCP
    two = ftconfig.replace(one, cluster={"nodes": 2})
    path = with_job_secret(two, str(tmp_path)).security.secret_file
    assert path == str(tmp_path / "job.secret") and len(credential.read_secret(path)) == 64
    assert credential.configured_secret(with_job_secret(two, str(tmp_path)), {}) == credential.read_secret(path)


def test_hosts_of_their_own_without_a_secret_are_refused_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv(credential.ENV, raising=False)
    cfg = ftconfig.replace(ftconfig.load(), cluster={"nodes": 2}, redundancy={"scheme": "none"},
                           health={"host_pattern": "node{node}"})
    with pytest.raises(ftconfig.ConfigError, match=r"security.secret_file='' is invalid: a job of hosts of their "
                                                   r"own needs the job's secret.*MFT_JOB_SECRET_FILE"):
        with_job_secret(cfg, str(tmp_path))
    secret = tmp_path / "s"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o644)
    monkeypatch.setenv(credential.ENV, str(secret))
    with pytest.raises(ftconfig.ConfigError, match="is readable by other users .* chmod 600"):
        with_job_secret(cfg, str(tmp_path))
    secret.chmod(0o600)
    assert with_job_secret(cfg, str(tmp_path)).security.secret_file == str(secret)


def test_launchers_of_one_machine_starting_together_read_one_whole_secret(tmp_path):
    """The generated file appears whole (written, then linked into place): no launcher reads it half-written
    or makes a second one."""
    for round_ in range(20):
        d, got, errors = str(tmp_path / str(round_)), [], []

        def launcher() -> None:
            try:
                got.append(credential.read_secret(credential.job_secret_file("", {}, d, False)))
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

        threads = [threading.Thread(target=launcher) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(got) == 4 and len(set(got)) == 1 and os.listdir(d) == ["job.secret"]


def test_a_secrets_bytes_count_whole_but_for_one_trailing_line_end(tmp_path):
    """Raw random bytes are not trimmed (a space or newline at either end is part of the secret, as every
    reader sees it); a text secret's line end is not."""
    raw = b" \n" + bytes(range(40, 60)) + b"\t\n "
    for name, data, want in (("raw", raw, raw), ("text", b"s" * 20 + b"\n", b"s" * 20),
                             ("crlf", b"s" * 20 + b"\r\n", b"s" * 20)):
        path = tmp_path / name
        path.write_bytes(data)
        path.chmod(0o600)
        assert credential.read_secret(str(path)) == want, name
