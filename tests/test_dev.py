"""The set-up's pins agree with each other: dev's torch versions, their lock files and pyproject.toml."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parent.parent
DEV = (ROOT / "dev").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _dev_versions() -> tuple[str, list[str]]:
    pinned = re.search(r"^TORCH_PINNED=(\S+)", DEV, re.M)
    ends = re.search(r"^RANGE_ENDS=\(([^)]*)\)", DEV, re.M)
    assert pinned and ends
    return pinned.group(1), ends.group(1).split()


def _lock(version: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of ``.ci/lock-torch-VERSION.txt``."""
    text = (ROOT / ".ci" / f"lock-torch-{version}.txt").read_text().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        spec, *hashes = line.split("--hash=")
        name, _, ver = spec.strip().partition("==")
        out[canonicalize_name(name)] = (ver, [h.strip() for h in hashes])
    return out


def _versions() -> list[str]:
    pinned, ends = _dev_versions()
    return [pinned, *ends]


@pytest.mark.parametrize("version", _versions())
def test_every_locked_package_has_an_exact_version_and_a_hash(version: str) -> None:
    lock = _lock(version)
    assert Version(lock["torch"][0]).base_version == version  # 2.13.0+cpu is 2.13.0's CPU build
    for name, (ver, hashes) in lock.items():
        assert re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", ver), (name, ver)
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name


@pytest.mark.parametrize("version", _versions())
def test_each_lock_satisfies_the_test_extra_and_the_build_backend(version: str) -> None:
    lock = _lock(version)
    extras = PYPROJECT["project"]["optional-dependencies"]
    wanted = [*PYPROJECT["project"]["dependencies"], *PYPROJECT["build-system"]["requires"]]
    for extra in ("test", "notebook"):
        wanted += [r for r in extras[extra] if not r.startswith("gradscope")]
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in lock, f"{name} is missing from the lock of torch {version}: run ./dev lock {version}"
        assert req.specifier.contains(lock[name][0], prereleases=True), (name, lock[name][0], str(req))


def test_the_test_tools_are_the_same_on_every_torch() -> None:
    """Only torch and what it pulls in differ between the locks: the suite's own tools do not."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    tools = {canonicalize_name(Requirement(r).name) for r in extras["test"] + extras["notebook"]}
    tools.discard("gradscope")
    locks = {v: _lock(v) for v in _versions()}
    for name in tools:
        assert len({lock[name][0] for lock in locks.values()}) == 1, name


def test_pyproject_states_the_range_that_ci_runs() -> None:
    _, ends = _dev_versions()
    (torch_req,) = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch")]
    oldest, newest = min(ends, key=Version), max(ends, key=Version)
    assert str(torch_req.specifier) == f">={Version(oldest).major}.{Version(oldest).minor}"
    page = (ROOT / "docs" / "torch-versions.md").read_text()  # the supported-torch page
    short = lambda v: f"{Version(v).major}.{Version(v).minor}"  # noqa: E731
    assert f"torch {short(oldest)} through {short(newest)}" in page
    assert f"torch {oldest} and {newest}" in page
    # the README's install line states the same range
    assert f"({short(oldest)} through {short(newest)})" in (ROOT / "README.md").read_text()
