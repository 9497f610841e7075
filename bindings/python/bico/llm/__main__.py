"""python3 -m bico.llm: see bico.llm.command.  Without torch (or numpy)
one line says which interpreter has them instead of a traceback.  The
command owns its process: BLIS's kernels and threads are chosen before
anything starts BLIS (bico._blis; the process may be executed again)."""
import signal
import sys


def _stop(sig, frame):
    """SIGINT, SIGTERM, SIGHUP before the command's own handlers
    (bico.llm.command) are set: the end a signal asks for, exit 128 + the
    signal, without a traceback of whatever module was loading."""
    raise SystemExit(128 + sig)


for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, _stop)

try:
    from .. import _blis
    _blis.own_process(sys.argv[1:])
    from .command import main
    from .ranks import leave
except ImportError as e:
    from .._deps import missing
    missing(e, "python3 -m bico.llm")

# a rank of several ends without the process group's teardown
# (bico.llm.ranks.leave); one process ends as Python ends it
try:
    status = main()
except BaseException as e:
    leave(e)
    raise
leave(status)
sys.exit(status)
