"""include/bico/version.h: the linked library's version."""
from ._lib import fn


def version():
    """The linked library's version string, e.g. "1.0.0"."""
    return fn.version_string().decode()


def version_number():
    return int(fn.version_number())
