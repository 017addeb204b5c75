"""``python -m megatron_ft.torchrun ARGS``: torch's torchrun (``torch.distributed.run``) with the
``megatron-ft`` rendezvous backend registered; ARGS are torchrun's. Whatever way torchrun's ``main``
ends (done, failed, a signal: torch does not shut the rendezvous down then), the backend's watcher is
stopped first: a thread inside the store's blocking wait when the interpreter finalizes aborts it."""
import sys

from torch.distributed import run

from .node_rendezvous import register, stop_all


def main() -> None:
    register()
    sys.argv[0] = "torchrun"
    try:
        run.main()
    finally:
        stop_all()


if __name__ == "__main__":
    main()
