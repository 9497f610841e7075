"""bico.llm.command.scratch: the run's scratch folder (locked while it
lives, removed by the next run when its owner is gone) and the signals
that end a run cleanly.
"""
import os
import re
import shutil
import tempfile

from ..._status import BicoError, E_IO
from .. import distill as _distill
from ..options import named as _named


def _scratch_of(a):
    """The run's scratch folder (the teacher's spill, the merged source of
    a LoRA): in --spill-dir when given (checked as the streamed fit's
    spill folder: it exists, lies in no input), else in $TMPDIR."""
    root = None
    if a.spill_dir is not None:
        from ..runtime import spill_folder
        ins = [f for f in (a.source, a.source_tuned, a.lora, a.target) if f]
        root = _named("--spill-dir", a.spill_dir, spill_folder,
                      a.output or a.output_lora, ins, a.spill_dir)
    try:
        return _scratch(root)
    except OSError as e:
        raise BicoError(E_IO, "%s: cannot make the run's scratch folder "
                        "there (%s)%s" % (root or tempfile.gettempdir(),
                                          e.strerror or e,
                                          "" if root else "; give "
                                          "--spill-dir"))


_LIVE = ".live"      # the lock file a run's scratch folder holds


def _scratch(root=None):
    """The run's temporary folder (<root>/bico-llm-<pid>-*, root: --spill-dir
    or $TMPDIR: the merged source of a LoRA, the teacher's spill), after
    removing those of runs that were killed (a SIGKILL leaves no time to
    clean up).  A run holds an exclusive flock(2) on its folder's .live
    file for as long as it runs; a leftover is a folder whose lock nobody
    holds.  A process id is never trusted: a run in another PID namespace
    (a container sharing the folder) has a pid this process cannot see,
    or one that names another process here.  A folder without the lock
    file (a run still starting) is left alone."""
    import fcntl
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    for n in names:
        if not re.match(r"bico-llm-\d+-", n):
            continue
        d = os.path.join(root, n)
        try:
            fd = os.open(os.path.join(d, _LIVE), os.O_RDONLY | os.O_CLOEXEC |
                         os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue                   # starting, not ours, or not a run's
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue               # another user's
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue                   # its run goes on
        finally:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
    d = tempfile.mkdtemp(prefix="bico-llm-%d-" % os.getpid(), dir=root)
    # locked under another name, then named .live: a scan never finds the
    # lock file of a live run unlocked
    fd = os.open(os.path.join(d, _LIVE + ".new"), os.O_RDWR | os.O_CREAT |
                 os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(os.path.join(d, _LIVE + ".new"), os.path.join(d, _LIVE))
    _SCRATCH_LOCKS.append(fd)          # held until the process ends
    return d


_SCRATCH_LOCKS = []


def _on_signals():
    """SIGINT, SIGTERM and SIGHUP end the command as an exception would:
    the output left as it was, the temporary folders (teacher spill,
    merged source) removed, exit status 128 + the signal, no traceback.
    The signal is remembered (bico.llm.distill.STOP) and raised again at
    the next step and before the output is swapped in, since Python drops
    an exception raised inside a finalizer or a library's callback (a
    KeyboardInterrupt there let a run finish and replace its output)."""
    import signal

    def stop(sig, frame):
        _distill.STOP.append(sig)   # raised again at the next step
        raise SystemExit(128 + sig)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(sig, stop)
        except (ValueError, OSError):   # not the main thread
            pass
