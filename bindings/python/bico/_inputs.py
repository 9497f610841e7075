"""bico._inputs: input files opened as the library opens them
(bico__open_input, lib/io/input.c): without blocking, and only regular
files, so that a FIFO, a socket or a device given as an input (a
tokenizer.json, a config.json, --text, --ids) is refused at once with a
message naming it, instead of hanging the process on open() or read(), or
reading /dev/zero until memory runs out.

    with open_input(path, "--text") as f: ...      # a binary file object
    text = read_input(path, "config.json", limit=64 << 20).decode()
"""
import errno
import os
import stat

from ._status import BicoError, E_ARG, E_IO, E_NOTFOUND

__all__ = ["open_input", "read_input", "check_input", "KINDS"]

# what a path that is not a regular file is, for messages
KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK,
                                                 "a block device"),
         (stat.S_ISDIR, "a folder"))


def _kind(mode):
    for test, name in KINDS:
        if test(mode):
            return name
    return "not a regular file"


def open_input(path, what=None):
    """The file at path opened for reading (a binary file object), after
    following symbolic links: opened without blocking (O_NONBLOCK: a FIFO
    with no writer cannot hang the open), then refused unless it is a
    regular file (BicoError E_ARG: "<what> <path>: a FIFO, not a regular
    file"; what None: the path alone); a missing file is E_NOTFOUND,
    another failure E_IO."""
    p = os.fspath(path)
    pre = "%s %s" % (what, p) if what else p
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise BicoError(E_NOTFOUND, "%s: no such file" % pre)
        if e.errno == errno.EISDIR:
            raise BicoError(E_ARG, "%s: a folder, not a file" % pre)
        raise BicoError(E_IO, "%s: cannot open it (%s)"
                        % (pre, e.strerror or e))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BicoError(E_ARG, "%s: %s, not a regular file (write it "
                            "to a file first)" % (pre, _kind(st.st_mode)))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_input(path, what=None):
    """Refuses what open_input refuses (the file is opened and closed)."""
    open_input(path, what).close()


def read_input(path, what=None, limit=None):
    """The bytes of a regular file (open_input's rules); a file larger
    than limit bytes is refused naming the limit (E_ARG), before any of it
    is read."""
    with open_input(path, what) as f:
        if limit is not None:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise BicoError(E_ARG, "%s: %d bytes, larger than the %d "
                                "such a file can be" % (
                                    "%s %s" % (what, path) if what else path,
                                    size, limit))
            return f.read(limit + 1)[:limit]
        return f.read()
