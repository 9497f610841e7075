"""A PEP 517 build backend for the pure-Python bico package that needs no
download: it zips bico/*.py and its sub-packages (bico/torch/, bico/llm/)
into a wheel (and the tree into an sdist).

pip's build isolation installs the backend's requirements from an index;
this one has none, so `pip install ./bindings/python` works offline.  The
version is read from pyproject.toml; BICO_LIBDIR, if set at build time, is
recorded in bico/_install.py as `make install` records its LIBDIR."""
import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "bico"


def _version():
    with open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8") as f:
        m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
    if not m:
        raise RuntimeError("pyproject.toml: no version")
    return m.group(1)


def _metadata():
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {_version()}\n"
            "Summary: Python binding of libbico: carry fine-tuning from one "
            "pretrained model to another\nRequires-Python: >=3.9\n"
            "Requires-Dist: numpy\nProvides-Extra: torch\n"
            "Requires-Dist: torch; extra == \"torch\"\n")


def _package_files():
    """(name in the archive, bytes) of bico/*.py and of its sub-packages'
    .py files (bico/torch/, bico/llm/), in a fixed order."""
    pkg = os.path.join(HERE, NAME)
    out = []
    for dp, dns, fns in os.walk(pkg):
        dns[:] = sorted(d for d in dns if d != "__pycache__")
        rel = os.path.relpath(dp, pkg)
        for fn in sorted(fns):
            if not fn.endswith(".py") or (rel == "." and fn == "_install.py"):
                continue
            arc = fn if rel == "." else f"{rel.replace(os.sep, '/')}/{fn}"
            with open(os.path.join(dp, fn), "rb") as f:
                out.append((f"{NAME}/{arc}", f.read()))
    libdir = os.environ.get("BICO_LIBDIR")
    if libdir:
        out.append((f"{NAME}/_install.py",
                    f"# Written by the wheel build.\nLIBDIR = {libdir!r}\n".encode()))
    return out


def _dist_info():
    return f"{NAME}-{_version()}.dist-info"


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    d = os.path.join(metadata_directory, _dist_info())
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w", encoding="utf-8") as f:
        f.write(_metadata())
    return _dist_info()


def _record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"{name},sha256={digest.decode()},{len(data)}"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    wheel_name = f"{NAME}-{_version()}-py3-none-any.whl"
    di = _dist_info()
    files = _package_files()
    files.append((f"{di}/METADATA", _metadata().encode()))
    files.append((f"{di}/WHEEL", b"Wheel-Version: 1.0\nGenerator: bico_build\n"
                  b"Root-Is-Purelib: true\nTag: py3-none-any\n"))
    record = [_record_line(n, d) for n, d in files] + [f"{di}/RECORD,,"]
    files.append((f"{di}/RECORD", ("\n".join(record) + "\n").encode()))
    path = os.path.join(wheel_directory, wheel_name)
    tmp = path + ".part"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files:
            z.writestr(zipfile.ZipInfo(n, date_time=(1980, 1, 1, 0, 0, 0)), d)
    os.replace(tmp, path)
    return wheel_name


def build_sdist(sdist_directory, config_settings=None):
    base = f"{NAME}-{_version()}"
    path = os.path.join(sdist_directory, base + ".tar.gz")
    tmp = path + ".part"
    with tarfile.open(tmp, "w:gz") as t:
        for rel in ["pyproject.toml", "_build/bico_build.py"] + \
                [n for n, _ in _package_files() if not n.endswith("_install.py")]:
            t.add(os.path.join(HERE, rel), arcname=f"{base}/{rel}")
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        data = _metadata().encode()
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)
    return os.path.basename(path)
