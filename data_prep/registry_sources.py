"""The pinned package archives the registry corpus is built from, their download and their licences.

A source is one archive pinned by name, version, file name and SHA-256: a PyPI sdist (found through the index's
PEP 691 JSON page, as pip finds it) or a Debian package (its pool path on a Debian mirror). A download is kept in
the cache directory and used again only if its SHA-256 still matches the pin.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.request
from dataclasses import asdict, dataclass
from email.parser import HeaderParser
from pathlib import Path

__all__ = ["RegistrySource", "DEFAULT_SOURCES", "load_sources", "fetch", "metadata_licence"]

PYPI_INDEX = "https://pypi.org/simple"
DEBIAN_MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True, kw_only=True)
class RegistrySource:
    registry: str  # "pypi" | "debian"
    name: str  # distribution / package name; rows carry it as their `source`
    version: str
    filename: str  # PyPI: the sdist file name; Debian: the pool path below the mirror
    sha256: str
    licence: str  # SPDX id, checked against the package's own metadata when the builder reads it
    include: str = ""  # only paths below this prefix are read (Debian packages: the HTML folder)

    def __post_init__(self):
        if self.registry not in ("pypi", "debian"):
            raise ValueError(f"{self.name}: registry must be pypi or debian, got {self.registry!r}")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits")

    @property
    def archive_name(self) -> str:
        return Path(self.filename).name

    def to_dict(self) -> dict:
        return asdict(self)


def _pypi(name, version, sha256, licence):
    return RegistrySource(registry="pypi", name=name, version=version, filename=f"{name}-{version}.tar.gz",
                          sha256=sha256, licence=licence)  # fmt: skip


# Permissively licensed projects whose sdists ship their documentation sources next to the code; ~42 MB of
# sdists plus the 12.6 MB Python 3.11 documentation package (HTML). Hashes are the index's (PEP 691 `hashes`).
DEFAULT_SOURCES: tuple[RegistrySource, ...] = (
    _pypi(
        "django", "5.2.4", "a1228c384f8fa13eebc015196db7b3e08722c5058d4758d20cb287503a540d8f", "BSD-3-Clause"
    ),
    _pypi(
        "sphinx", "8.2.3", "398ad29dee7f63a75888314e9424d40f52ce5a6a87ae88e7071e80af296ec348", "BSD-2-Clause"
    ),
    _pypi("sqlalchemy", "2.0.41", "edba70118c4be3c2b1f90754d308d0b79c6fe2c0fdc52d8ddf603916f83f4db9", "MIT"),
    _pypi("pytest", "8.4.1", "7c67fd69174877359ed9371ec3af8a3d2b04741818c51e5e99cc1742251fa93c", "MIT"),
    _pypi(
        "click", "8.2.1", "27c491cc05d968d271d5a1db13e3b5a184636d9d930f148c50b038f0d0646202", "BSD-3-Clause"
    ),
    _pypi(
        "flask", "3.1.1", "284c7b8f2f58cb737f0cf1c30fd7eaf0ccfcde196099d24ecede3fc2005aa59e", "BSD-3-Clause"
    ),
    _pypi(
        "jinja2", "3.1.6", "0137fb05990d35f1275a587e9aee6d56da821fc83491a0fb838183be43f66d6d", "BSD-3-Clause"
    ),
    _pypi(
        "werkzeug",
        "3.1.3",
        "60723ce945c19328679790e3282cc758aa4a6040e4bb330f53d30fa546d44746",
        "BSD-3-Clause",
    ),
    _pypi("attrs", "25.3.0", "75d7cefc7fb576747b2c81b4442d4d4a1ce0900973527c011d1030fd3bf4af1b", "MIT"),
    _pypi(
        "requests", "2.32.4", "27d0316682c8a29834d3264820024b62a36942083d52caf2f14c0591336d3422", "Apache-2.0"
    ),
    _pypi(
        "docutils",
        "0.21.2",
        "3a6b18732edf182daa3cd12775bbb338cf5691468f91eeeb109deff6ebfa986f",
        "BSD-2-Clause AND PSF-2.0 AND LicenseRef-Public-Domain",
    ),  # fmt: skip
    _pypi("alembic", "1.16.2", "e53c38ff88dadb92eb22f8b150708367db731d58ad7e9d417c9168ab516cbed8", "MIT"),
    _pypi(
        "markdown",
        "3.8.2",
        "247b9a70dd12e27f67431ce62523e675b866d254f900c4fe75ce3dda62237c45",
        "BSD-3-Clause",
    ),
    _pypi(
        "pygments",
        "2.19.2",
        "636cb2477cec7f8952536970bc533bc43743542f70392ae026374600add5b887",
        "BSD-2-Clause",
    ),
    RegistrySource(
        registry="debian",
        name="python3.11-doc",
        version="3.11.2-6+deb12u8",
        filename="pool/main/p/python3.11/python3.11-doc_3.11.2-6+deb12u8_all.deb",
        sha256="50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
        licence="PSF-2.0",
        include="usr/share/doc/python3.11/html/",
    ),
)


def load_sources(spec: str) -> tuple[RegistrySource, ...]:
    """'default' -> DEFAULT_SOURCES, 'none' -> (), else a JSON file: a list of RegistrySource fields."""
    if spec == "default":
        return DEFAULT_SOURCES
    if spec == "none":
        return ()
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--sources {spec!r}: neither 'default', 'none' nor a JSON file")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        return tuple(RegistrySource(**entry) for entry in entries)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"--sources {spec}: expected a JSON list of source objects ({e})") from e


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download(url: str, accept: str | None = None) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310 (fixed https/http registries)
        return response.read()


def _pypi_url(source: RegistrySource, index: str) -> str:
    page = json.loads(_download(f"{index}/{source.name}/", accept="application/vnd.pypi.simple.v1+json"))
    for entry in page.get("files", []):
        if entry["filename"] == source.filename:
            listed = entry.get("hashes", {}).get("sha256")
            if listed and listed != source.sha256:
                raise ValueError(
                    f"{source.filename}: the index lists sha256 {listed}, the pin says {source.sha256}"
                )
            return entry["url"]
    raise ValueError(f"{source.filename} is not on {index}/{source.name}/")


def fetch(source: RegistrySource, cache: Path, *, index: str = PYPI_INDEX, mirror: str = DEBIAN_MIRROR,
          offline: bool = False) -> bytes:  # fmt: skip
    """The archive's bytes, from the cache when its hash matches the pin, else downloaded and checked."""
    path = cache / source.archive_name
    if path.is_file():
        data = path.read_bytes()
        if sha256_of(data) == source.sha256:
            return data
        if offline:
            raise ValueError(f"{path}: sha256 {sha256_of(data)} does not match the pin {source.sha256}")
    elif offline:
        raise FileNotFoundError(f"{path} is not in the cache and --offline forbids downloading it")
    url = _pypi_url(source, index) if source.registry == "pypi" else f"{mirror}/{source.filename}"
    data = _download(url)
    got = sha256_of(data)
    if got != source.sha256:
        raise ValueError(f"{url}: downloaded sha256 {got} does not match the pin {source.sha256}")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    tmp.write_bytes(data)
    tmp.replace(path)
    return data


def metadata_licence(members: dict[str, bytes | None]) -> dict:
    """What the package says about its licence: the PKG-INFO / METADATA fields (License-Expression, License,
    license classifiers), the licence files it ships, and for Debian packages the copyright file's License
    fields. Recorded in the manifest beside the pinned SPDX id, so a reader can check one against the other."""
    found: dict = {
        "files": sorted(p for p in members if re.search(r"(^|/)(licen[cs]e|copying)[^/]*$", p, re.I))
    }
    for path in ("PKG-INFO", *sorted(p for p in members if p.endswith(".dist-info/METADATA"))):
        raw = members.get(path)
        if not raw:
            continue
        headers = HeaderParser().parsestr(raw.decode("utf-8", "replace"))
        found["license_expression"] = headers.get("License-Expression")
        licence = headers.get("License")
        found["license"] = licence.splitlines()[0][:200] if licence else None
        found["classifiers"] = [c for c in headers.get_all("Classifier", []) if c.startswith("License ::")]
        break
    copyrights = [p for p in members if p.endswith("/copyright") and p.startswith("usr/share/doc/")]
    for path in sorted(copyrights)[:1]:
        text = (members[path] or b"").decode("utf-8", "replace")
        # Only a machine-readable (DEP-5) copyright file has License fields; otherwise name the file to read.
        found["debian_copyright"] = (
            sorted(set(re.findall(r"^License:\s*(\S+)", text, re.M))) if text.startswith("Format:") else path
        )
    return found
