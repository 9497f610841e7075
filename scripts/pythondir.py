"""Prints where `make install PREFIX=...` puts the Python package: the
folder this interpreter itself searches for PREFIX, so that no PYTHONPATH
is needed for the usual prefixes.

Debian's python3 searches /usr/local/lib/python3.X/dist-packages (scheme
posix_local) and /usr/lib/python3/dist-packages (deb_system); any other
prefix gets the upstream layout PREFIX/lib/python3.X/site-packages, which a
user adds to PYTHONPATH (the README says so)."""
import sys
import sysconfig

prefix = sys.argv[1].rstrip("/") or "/"
schemes = sysconfig.get_scheme_names()
if prefix == "/usr/local" and sysconfig.get_default_scheme() == "posix_local":
    print(sysconfig.get_path("purelib", "posix_local"))
elif prefix == "/usr" and "deb_system" in schemes:
    print(sysconfig.get_path("purelib", "deb_system"))
else:
    print(sysconfig.get_path("purelib", "posix_prefix",
                             vars={"base": prefix, "platbase": prefix}))
