"""The one thing pyproject.toml cannot yet declare stably: the verbs
transport's compiled core (kvwired/transport/verbs/core.py says why it is
C). Optional: a node without libibverbs' headers still installs and runs the
TCP transport, and the verbs transport then says what to install."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvwired.transport.verbs._ibv",
                             ["kvwired/transport/verbs/_ibv.c"], libraries=["ibverbs"],
                             extra_compile_args=["-O2", "-Wall"], optional=True)])
