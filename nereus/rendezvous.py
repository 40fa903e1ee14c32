"""torchrun's rendezvous backend ``nereus``: torch's c10d backend with every round's workers'
store published (``nereus.launch.publish_store_every_round``).

torch 2.13's dynamic rendezvous writes the address of the workers' store only in a node's
first round, so under ``torchrun --rdzv-backend c10d`` a node that joins a running job waits
for keys no one writes and both sides fail after 60 s. Installing Nereus registers this
backend with torchrun (the ``torchrun.handlers`` entry point, which torch loads when its
rendezvous package is imported)::

    torchrun --nnodes 1:2 --max-restarts 2 --rdzv-backend nereus --rdzv-endpoint HOST:PORT \\
        --rdzv-id JOB $(which nereus) train CONFIG

It takes c10d's ``--rdzv-endpoint`` and ``--rdzv-conf`` as they are. This module imports
nothing at load time: torch loads it while its own rendezvous package is half imported.
"""

from __future__ import annotations

BACKEND = "nereus"


def create_handler(params):
    """A c10d rendezvous handler whose every round names its own rank 0's workers' store
    (torch checks that a handler reports the backend it was asked for: this one's name)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler

    from nereus.launch import publish_store_every_round

    class Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return BACKEND

    publish_store_every_round()
    _, store = create_backend(params)  # c10d's store (hosted here or joined) and its backend's state
    return dynamic_handler(store, Backend(store, params.run_id), params)


def handler_generator():
    """The ``torchrun.handlers`` entry point: torch calls it and registers what it returns."""
    return create_handler
