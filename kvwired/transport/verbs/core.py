"""The compiled verbs core (``_ibv``, built from ``_ibv.c`` when kvwire is
installed), or a clear error saying how to build it.

The data path's queue pairs, completion queues and registrations live there
(see the C source's header for why not pyverbs); what each does is in
``_ibv.pyi``.
"""

from __future__ import annotations

from ...errors import TransportError

try:
    from ._ibv import *  # noqa: F403
    from ._ibv import VerbsError
except ImportError as exc:  # built at install: only a build without the headers lacks it
    raise TransportError(
        f"kvwire's compiled verbs core is not built ({exc})",
        hint="install libibverbs-dev, python3-dev and gcc (scripts/install-system-packages.sh "
             "does), then reinstall kvwire (`make setup`, or pip install again)") from exc

__all__ = ["VerbsError"]
