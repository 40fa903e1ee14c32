"""Nereus: adaptive-parallelism runtime for RL post-training of LLMs.

The sub-packages live in root folders mapped here by pyproject.toml:
``nereus.reshard`` (reshard/), ``nereus.store`` (store/), ``nereus.trainer``
(trainer/), ``nereus.cli`` (cli/), ``nereus.configs`` (configs/: job configs as package data).

This folder's own files:

- ``launch``      N local worker processes through torch.distributed's elastic launcher, or one
                  worker under torchrun; the agent's restarts and every round's store published
- ``rendezvous``  torchrun's rendezvous backend ``nereus`` (``--rdzv-backend nereus``): c10d with
                  every round's workers' store published
"""

import os as _os

__version__ = "0.1.0"

# In a source checkout (repository root on sys.path: pytest, `python -m` from the
# root) this folder shadows an installed copy, and the package-dir mapping of
# pyproject.toml does not apply. Looking for sub-packages in the root as well makes
# `nereus.reshard` resolve to reshard/ there too. Installed copies have no
# pyproject.toml beside them and are unaffected.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(
    _os.path.join(_root, "reshard")
):
    __path__.append(_root)
del _root
