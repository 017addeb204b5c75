"""torchrun as ``megatron-ft launch`` runs it: torch's own ``torch.distributed.run`` with the ``megatron-ft``
rendezvous backend registered first (:mod:`.node_rendezvous`). ``python -m megatron_ft.torchrun ARGS``
takes torchrun's arguments. Kept apart from :mod:`megatron_ft.launch` so that a torchrun imports no
more of megatron-ft than its rendezvous (its start-up is on the path of every generation)."""
