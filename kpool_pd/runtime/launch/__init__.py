"""Starting local processes, the one way the project does it (``kpool-pd up``, the tests, the benches).

- ``daemons``: a daemon as a subprocess (``python -m <module> ...``, its own session, a log file and
  a ready file, stopped by SIGTERM then SIGKILL): ``kpool-pd up`` and the end-to-end tests;
- ``children``: a Python function in a child process (multiprocessing), by default forked from a
  server that has torch imported already, so that a child does not pay the import again: the
  tests' connector nodes and the benches' peers.
"""

from kpool_pd.runtime.launch.children import ChildKind, child_context, start_child
from kpool_pd.runtime.launch.daemons import Daemon, DaemonError, start_decode, start_prefill

__all__ = ["ChildKind", "Daemon", "DaemonError", "child_context", "start_child", "start_decode", "start_prefill"]
