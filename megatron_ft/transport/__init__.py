"""Trainer-side transports of checkpoint traffic to peers (issue 4). ``redundancy.transport: agent``
needs nothing here (the agents exchange, :mod:`megatron_ft.agent.redundancy`); ``scheduled`` is
:mod:`.scheduled`."""
