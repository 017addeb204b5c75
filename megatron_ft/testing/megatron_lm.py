"""Upstream Megatron-LM as the demo's and the tests' training program (harness only).

* :func:`patched_tree` copies an unpatched Megatron-LM tree (a directory or the project's archive of
  one of :data:`TAGS`) and applies the series of ``patches/megatron-lm/`` that matches it with
  ``scripts/apply_megatron_patches.sh`` (:func:`series_of` says which).
* :func:`demo_args` are upstream ``pretrain_gpt.py`` arguments for the demo's tiny GPT (mock data,
  NullTokenizer) on a given cluster shape.
* Run as a script (``python megatron_lm.py PRETRAIN_SCRIPT ARGS...``, the launcher's training
  script), it runs the upstream script unchanged in this process after wrapping
  ``megatron.training.training.train_step`` to append, after every completed iteration, one JSON line
  to ``$MFT_RUN_DIR/progress/rank{R}.jsonl``: the iteration, the loss (hex; last pipeline stage), and a
  SHA-256 of this rank's parameters, bit for bit. At exit it writes the last iteration's digest to
  ``$MFT_RUN_DIR/final/state.rank{R}.json``. That is what the demo compares with a reference run.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tarfile
import time
from typing import Any, Optional

from megatron_ft.trainer import in_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the releases with a patch series (patches/megatron-lm/<tag>), the newest first
TAGS = tuple(sorted(os.listdir(os.path.join(REPO, "patches", "megatron-lm")), reverse=True))
TAG = TAGS[0]  # the release the demo and the default tests run


def _archives(tag: str) -> list[str]:
    """Where the shared archive may be: beside this checkout, or beside the checkout it was cloned
    from (a clean clone elsewhere, as CI makes)."""
    roots = [os.path.dirname(REPO)]
    try:
        origin = subprocess.run(["git", "-C", REPO, "remote", "get-url", "origin"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        if origin and os.path.isdir(origin):
            roots.append(os.path.dirname(os.path.abspath(origin)))
    except (OSError, subprocess.SubprocessError):
        pass
    return [os.path.join(r, "shared", "upstream", f"megatron-lm-{tag}.tar.gz") for r in roots]


def source(tag: str = TAG) -> Optional[str]:
    """An unpatched upstream tree or archive of release ``tag``: ``MEGATRON_LM_DIR`` (``tag`` is the
    newest release) else the shared archive (:func:`_archives`), else None. ``MEGATRON_LM_ARCHIVE``
    overrides the newest release's archive."""
    if tag == TAG:
        for var in ("MEGATRON_LM_DIR", "MEGATRON_LM_ARCHIVE"):
            if os.environ.get(var):
                return os.environ[var]
    return next((a for a in _archives(tag) if os.path.exists(a)), None)


def series_of(tree: str) -> str:
    """The release whose series :func:`patched_tree` applied to ``tree``."""
    with open(os.path.join(tree, ".megatron-ft-patched"), encoding="utf-8") as f:
        return f.read().split()[0]


def extract_archive(path: str, dst: str) -> None:
    """Extract the tar archive ``path`` into ``dst``, refusing what a source tree never holds: a member
    outside ``dst`` (an absolute name, ``..``, a link that points out), a device or a FIFO. Python's own
    ``filter="data"`` where it has it (3.11.4 and later); the same checks by hand before (Debian 12's
    3.11.2), with the permissions a plain extraction gives."""
    with tarfile.open(path) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dst, filter="data")
            return
        root = os.path.realpath(dst)
        for m in tf.getmembers():
            target = os.path.realpath(os.path.join(root, m.name))
            link = os.path.realpath(os.path.join(os.path.dirname(target), m.linkname)) if m.issym() else \
                os.path.realpath(os.path.join(root, m.linkname)) if m.islnk() else target
            if not (m.isfile() or m.isdir() or m.issym() or m.islnk()) or os.path.isabs(m.name) or \
                    not all(os.path.commonpath([root, t]) == root for t in (target, link)):
                raise ValueError(f"{path}: member {m.name!r} would land outside {dst} or is not a plain file, "
                                 f"directory or link inside it: refused")
        tf.extractall(dst)


def patched_tree(src: str, dst: str) -> str:
    """An unpatched Megatron-LM ``src`` (directory or ``.tar.gz`` of ``Megatron-LM/``) copied to ``dst``
    with the patch series of its release applied (the script picks it; :func:`series_of`); reused when
    ``dst`` already holds it from the same source and series. Returns ``dst``."""
    stamp = os.path.join(dst, ".megatron-ft-patched")
    root = os.path.join(REPO, "patches", "megatron-lm")
    want = hashlib.sha256(os.path.abspath(src).encode() + b"".join(
        open(os.path.join(root, t, p), "rb").read() for t in TAGS for p in sorted(os.listdir(os.path.join(root, t)))
    )).hexdigest()
    if os.path.exists(stamp) and open(stamp).read().split()[-1] == want:
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    if os.path.isdir(src):
        if not os.path.exists(os.path.join(src, "pretrain_gpt.py")):
            raise FileNotFoundError(f"--megatron-lm {src}: no pretrain_gpt.py there (a Megatron-LM tree of one of "
                                    f"{', '.join(TAGS)})")
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    else:
        tmp = dst + ".extract"
        shutil.rmtree(tmp, ignore_errors=True)
        extract_archive(src, tmp)
        inner = [d for d in os.listdir(tmp) if os.path.isdir(os.path.join(tmp, d))]
        shutil.move(os.path.join(tmp, inner[0]) if len(inner) == 1 else tmp, dst)
        shutil.rmtree(tmp, ignore_errors=True)
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_megatron_patches.sh"), dst],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"no patch series applies to {src}:\n{out.stdout}{out.stderr}")
    applied = re.search(r"megatron-ft patch series (\S+) applied", out.stdout)
    with open(stamp, "w") as f:
        f.write(f"{applied.group(1) if applied else '?'} {want}")
    return dst


class UpstreamImportError(RuntimeError):
    """Upstream's training code does not import in this Python; the message names the missing module."""


_MISSING = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def check_imports(tree: str, timeout_s: float = 300.0) -> None:
    """Import upstream ``pretrain_gpt`` (and with it ``megatron.training``) from the patched ``tree`` in
    a child of this Python, before anything runs with it; raise :class:`UpstreamImportError` naming
    the module that is missing (or the import's last lines), and how to install it. Bounded by
    ``timeout_s``."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import pretrain_gpt"
    try:
        out = subprocess.run([sys.executable, "-c", code, tree], cwd=tree, capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UpstreamImportError(f"upstream Megatron-LM in {tree} did not import within {timeout_s:g} s") from None
    if out.returncode == 0:
        return
    missing = _MISSING.findall(out.stderr)
    if missing:
        top = missing[-1].split(".")[0]
        raise UpstreamImportError(
            f"upstream Megatron-LM in {tree} does not import in {sys.executable}: module {missing[-1]!r} is missing. "
            f"Install megatron-ft's megatron extra, which brings what upstream's training code imports "
            f"(pip install 'megatron-ft[megatron]'), or the module itself (pip install {top})")
    tail = "\n".join(out.stderr.strip().splitlines()[-6:])
    raise UpstreamImportError(f"upstream Megatron-LM in {tree} does not import in {sys.executable} "
                              f"(exit {out.returncode}):\n{tail}")


def demo_args(tensor: int, pipeline: int, data: int, iters: int, run_dir: str) -> list[str]:
    """Upstream ``pretrain_gpt.py`` arguments: the demo's tiny GPT, mock data, 2 micro-batches per
    data-parallel rank, dropout 0.1 (upstream's default), ``--save``/``--load`` in ``run_dir``, and the
    dataset's index cache there too (a real dataset caches its indices beside its files by default;
    mock data only with ``--data-cache-path``: without it every trainer, restarted ones included,
    would shuffle its whole index again)."""
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--global-batch-size", str(4 * data),
        "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--tensor-model-parallel-size", str(tensor), "--pipeline-model-parallel-size", str(pipeline),
        "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--save", os.path.join(run_dir, "megatron-save"), "--load", os.path.join(run_dir, "megatron-save"),
        "--save-interval", "1000000", "--data-cache-path", os.path.join(run_dir, "data-cache"),
    ]


def _digest(model: list) -> str:
    """SHA-256 of this rank's parameters and module buffers (a MoE router's ``expert_bias``, which the
    gradient finalisation updates outside the optimizer), names and bytes."""
    h = hashlib.sha256()
    for chunk in model:
        for name, p in [*chunk.named_parameters(), *(("buffer." + n, b) for n, b in chunk.named_buffers())]:
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


class _Recorder:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.last: Optional[dict] = None
        self._file: Any = None
        self.rank = int(os.environ.get("RANK", "0"))
        self.saves: list[float] = []

    def record(self, iteration: int, model: list, loss_dict: Any) -> None:
        import torch.distributed as dist

        rank = dist.get_rank()
        if self._file is None:
            os.makedirs(os.path.join(self.run_dir, "progress"), exist_ok=True)
            self._file = open(os.path.join(self.run_dir, "progress", f"rank{rank}.jsonl"), "a", encoding="utf-8")
        loss = None
        if isinstance(loss_dict, dict) and loss_dict:
            v = loss_dict.get("lm loss", next(iter(loss_dict.values())))
            loss = float(v[0] / v[1]) if isinstance(v, (tuple, list)) else float(v)
        self.last = {"rank": rank, "pid": os.getpid(), "iteration": iteration, "time": time.time(),
                     "loss_hex": None if loss is None else loss.hex(), "state_digest": _digest(model),
                     "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                     "in_process_attempt": in_process.attempt()[0]}
        self._file.write(json.dumps(self.last) + "\n")
        self._file.flush()

    def timed_save(self, seconds: float) -> None:
        self.saves.append(seconds)

    def write_final(self) -> None:
        if self.saves:  # Megatron's whole in-memory save calls (its state dict + megatron-ft's part)
            os.makedirs(os.path.join(self.run_dir, "saves"), exist_ok=True)
            with open(os.path.join(self.run_dir, "saves", f"rank{self.rank}.pid{os.getpid()}.json"), "w") as f:
                json.dump({"rank": self.rank, "seconds": self.saves}, f)
        if self.last is None:
            return
        os.makedirs(os.path.join(self.run_dir, "final"), exist_ok=True)
        with open(os.path.join(self.run_dir, "final", f"state.rank{self.last['rank']}.json"), "w") as f:
            json.dump({"parameters": {"iteration": self.last["iteration"], "sha256": self.last["state_digest"]}}, f)


#: the harness's own option, taken out of the arguments before Megatron sees them: every iteration padded to
#: at least this many seconds (a demo that must act while the job still trains: the elastic one)
PACE = "--mft-min-iteration-s"


def _paced(args: list[str]) -> tuple[list[str], float]:
    """``args`` without :data:`PACE` and its value, and that value (0: not given).

    >>> _paced(["--lr", "1", "--mft-min-iteration-s", "0.5", "--seed", "3"])
    (['--lr', '1', '--seed', '3'], 0.5)
    """
    if PACE not in args:
        return list(args), 0.0
    i = args.index(PACE)
    return [*args[:i], *args[i + 2:]], float(args[i + 1])


def run(script: str, args: list[str]) -> None:
    """Run upstream ``script`` with ``args`` in this process, recording every iteration."""
    args, pace = _paced(args)
    script = os.path.abspath(script)
    tree = os.path.dirname(script)
    sys.argv[:] = [script, *args]
    sys.path.insert(0, tree)
    import megatron.training.training as training

    recorder = _Recorder(os.environ.get("MFT_RUN_DIR", os.getcwd()))
    orig = training.train_step

    def train_step(*a: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        out = orig(*a, **kw)
        time.sleep(max(0.0, pace - (time.monotonic() - t0)))
        model = kw.get("model", a[2] if len(a) > 2 else None)
        iteration = kw.get("iteration")
        if iteration is not None and model is not None:
            recorder.record(int(iteration) + 1, model, out[0])
        return out

    orig_save = training.save_checkpoint_and_time

    def save_checkpoint_and_time(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = orig_save(*a, **kw)
        if kw.get("non_persistent_ckpt"):
            recorder.timed_save(time.perf_counter() - t0)
        return out

    training.train_step = train_step
    training.save_checkpoint_and_time = save_checkpoint_and_time
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        recorder.write_final()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: megatron_lm.py PRETRAIN_SCRIPT [ARGS...]")
    run(sys.argv[1], sys.argv[2:])
