"""Trainer-side transports of checkpoint traffic to peers. ``redundancy.transport: agent``
needs nothing here (the agents exchange, :mod:`megatron_ft.agent.redundancy`); ``scheduled`` is
:mod:`.scheduled`."""
