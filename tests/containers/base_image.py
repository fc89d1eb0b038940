"""The ``PYTHON_IMAGE`` the Dockerfiles build on, made from Debian packages: no registry needed.

The Dockerfiles default to ``python:3.11-slim`` from Docker Hub, which no registry here serves.
Debian bookworm ships Python 3.11, so ``debootstrap`` builds a stand-in from the Debian mirror
(``--variant=minbase`` plus ``python3``, ``python3-venv``, ``python-is-python3`` and
``ca-certificates``): ``python`` on the PATH, ``python -m venv`` with pip, ``useradd``; what the
Dockerfiles use of ``python:3.11-slim``. The host's CA bundle replaces Debian's inside it and
``/etc/pip.conf`` names it, so that pip in the image trusts what this host trusts (an egress proxy
that re-signs TLS needs its own root).

``root_tarball`` builds the root file system once, as a tar file cached under ``cache_dir`` and
keyed by the recipe and the CA bundle's digest (about 70 s and 160 MB the first time);
``import_image`` turns it into an image with ``docker import`` (seconds). Needs root and
debootstrap (``make test-containers`` installs it).
"""

from __future__ import annotations

import hashlib
import pathlib
import re
import shutil
import subprocess
import tempfile

SUITE = "bookworm"  # Debian 12: Python 3.11, as python:3.11-slim
PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
HOST_CA_BUNDLE = pathlib.Path("/etc/ssl/certs/ca-certificates.crt")
SOURCES = (pathlib.Path("/etc/apt/sources.list"), pathlib.Path("/etc/apt/sources.list.d"))
# what python:3.11-slim sets and the Dockerfiles rely on
IMAGE_CHANGES = ('ENV LANG=C.UTF-8', 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin',
                 'CMD ["python3"]')
# left out of the image: apt's downloaded packages and lists, documentation, translations
STRIP = ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "usr/share/doc/*", "usr/share/man/*",
         "usr/share/locale/*", "var/log/*")
DEBOOTSTRAP_TIMEOUT_S = 900


def debian_mirror() -> str:
    """The Debian archive this host's apt uses (a ``URIs:`` or ``deb`` line whose path ends in
    ``/debian``, not the security archive), else ``DEFAULT_MIRROR``."""
    files = [p for p in SOURCES if p.is_file()]
    files += sorted(q for p in SOURCES if p.is_dir() for q in p.iterdir() if q.suffix in (".list", ".sources"))
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            line = line.strip()
            m = re.match(r"URIs:\s*(\S+)", line) or re.match(r"deb\s+(?:\[[^]]*\]\s+)?(\S+)", line)
            if m and m.group(1).rstrip("/").endswith("/debian"):
                return m.group(1).rstrip("/")
    return DEFAULT_MIRROR


def recipe_key(mirror: str, ca_bundle: pathlib.Path = HOST_CA_BUNDLE) -> str:
    """16 hex digits naming what the root file system is made of (suite, packages, changes,
    stripped paths, mirror, the CA bundle's bytes)."""
    h = hashlib.sha256(repr((SUITE, PACKAGES, IMAGE_CHANGES, STRIP, mirror)).encode())
    h.update(ca_bundle.read_bytes())
    return h.hexdigest()[:16]


def root_tarball(cache_dir: pathlib.Path, log: pathlib.Path) -> pathlib.Path:
    """The root file system as a tar file under ``cache_dir`` (built by debootstrap when missing;
    its output goes to ``log``). Raises RuntimeError naming the log if debootstrap fails, and
    FileNotFoundError if debootstrap or the host's CA bundle is missing."""
    debootstrap = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin:/sbin")
    if debootstrap is None:
        raise FileNotFoundError("debootstrap is not installed (apt-get install debootstrap; make test-containers "
                                "does it as root)")
    if not HOST_CA_BUNDLE.is_file():
        raise FileNotFoundError(f"the host's CA bundle {HOST_CA_BUNDLE} is missing (apt-get install ca-certificates)")
    mirror = debian_mirror()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tarball = cache_dir / f"python-3.11-{SUITE}-{recipe_key(mirror)}.tar"
    if tarball.is_file():
        return tarball
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix="rootfs-") as tmp:
        root = pathlib.Path(tmp) / "root"
        with open(log, "ab") as out:
            run = subprocess.run(
                [debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(root), mirror],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=DEBOOTSTRAP_TIMEOUT_S)
        if run.returncode != 0:
            raise RuntimeError(f"debootstrap {SUITE} from {mirror} failed ({run.returncode}); see {log}")
        for pattern in STRIP:
            for path in root.glob(pattern):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        shutil.copyfile(HOST_CA_BUNDLE, root / "etc/ssl/certs/ca-certificates.crt")
        (root / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
        partial = tarball.with_suffix(".tar.part")
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], check=True,
                       timeout=300, stdin=subprocess.DEVNULL)
        partial.rename(tarball)
    for stale in cache_dir.glob(f"python-3.11-{SUITE}-*.tar"):  # other recipes' tarballs
        if stale != tarball:
            stale.unlink()
    return tarball


def import_image(docker, tarball: pathlib.Path, tag: str, labels: dict[str, str]) -> str:
    """``docker import`` of ``tarball`` as ``tag`` with ``labels`` (inherited by every image built
    FROM it: they find the images a run made); its image id."""
    changes = [*IMAGE_CHANGES, *(f"LABEL {k}={v}" for k, v in labels.items())]
    args = ["import", *(a for c in changes for a in ("--change", c)), str(tarball), tag]
    return docker(*args, timeout=300).stdout.strip()
