"""An upstream Megatron-LM archive extracted (megatron_ft/testing/megatron_lm.py ``extract_archive``) on every
Python the project supports: with Python's own ``filter="data"`` where it exists, and by the same checks by
hand where it does not (Debian 12's 3.11.2): a plain tree lands whole; a member outside the destination, a
link pointing out of it, a device, are refused before anything lands."""
import io
import os
import tarfile

import pytest

from megatron_ft.testing.megatron_lm import extract_archive


def archive(tmp_path, name, members):
    path = tmp_path / name
    with tarfile.open(path, "w:gz") as tf:
        for m, data in members:
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
    return str(path)


def file_(name, data=b"x = 1\n"):
    m = tarfile.TarInfo(name)
    m.size = len(data)
    return m, data


def link(name, target, kind=tarfile.SYMTYPE):
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, target
    return m, None


@pytest.fixture(params=["python's filter", "by hand"])
def how(request, monkeypatch):
    if request.param == "by hand":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile filter")
    return request.param


def test_a_plain_tree_lands_whole(tmp_path, how):
    src = archive(tmp_path, "ok.tar.gz", [file_("Megatron-LM/pretrain_gpt.py"), file_("Megatron-LM/megatron/a.py"),
                                          link("Megatron-LM/b.py", "megatron/a.py")])
    extract_archive(src, str(tmp_path / "out"))
    assert open(tmp_path / "out" / "Megatron-LM" / "b.py").read() == "x = 1\n"
    assert os.path.isfile(tmp_path / "out" / "Megatron-LM" / "pretrain_gpt.py")


@pytest.mark.parametrize("members", [
    [file_("../escaped.py")],
    [file_("/tmp/absolute-mft-test.py")],
    [link("Megatron-LM/out", "../../outside")],
    [link("Megatron-LM/hard", "../outside", kind=tarfile.LNKTYPE)],
    [(tarfile.TarInfo("Megatron-LM/dev"), None)],
], ids=["dotdot", "absolute", "symlink-out", "hardlink-out", "device"])
def test_a_member_that_would_land_outside_or_is_not_a_tree_s_is_refused(tmp_path, how, members):
    if members[0][0].name.endswith("dev"):
        members[0][0].type = tarfile.CHRTYPE
    src = archive(tmp_path, "bad.tar.gz", [file_("Megatron-LM/pretrain_gpt.py"), *members])
    if how == "python's filter" and members[0][0].name.startswith("/"):  # its filter strips the leading "/"
        extract_archive(src, str(tmp_path / "out"))
        assert os.path.isfile(tmp_path / "out" / "tmp" / "absolute-mft-test.py")
        assert not os.path.exists("/tmp/absolute-mft-test.py")
        return
    with pytest.raises(Exception) as e:
        extract_archive(src, str(tmp_path / "out"))
    if how == "by hand":
        assert "refused" in str(e.value) and members[0][0].name in str(e.value)
        assert not os.path.exists(tmp_path / "out")  # nothing landed
    assert not os.path.exists("/tmp/absolute-mft-test.py") and not os.path.exists(tmp_path / "escaped.py")
