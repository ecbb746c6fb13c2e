"""The package's metadata resolves, for the base and every extra, with pip's resolver
(resolvelib, as vendored by pip) over a metadata-only index built here: nothing is downloaded.

The index holds, per package, the versions a user can meet: the pinned CPU lock
(tools/requirements-cpu.txt, the versions installed in this environment) and the GPU world's
versions below (a CUDA image's torch 2.11, SGLang 0.5.23's torch 2.14.1 and transformers
5.19.0 pins, transformer-engine 2.20.2). Their dependency lists are the parts of their
metadata that constrain the trainer's packages (recorded here, not downloaded). The check is
shown to catch the conflict of the previous setup.py (exact torch/transformers pins with
sglang in the gpu extra): ``test_previous_setup_conflicts``.
"""

from __future__ import annotations

import importlib.metadata
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def _pip_resolvelib():
    """pip's vendored resolvelib, loaded from its files under another name. Importing ``pip``
    (even finding its spec) disables setuptools' distutils shim for the whole process
    (``_distutils_hack``'s ``spec_for_pip``), after which every first import of setuptools
    fails its assertion: in a full test session that broke every later fixture that built a
    checkpoint."""
    import importlib.util
    import sysconfig

    init = Path(sysconfig.get_paths()["purelib"]) / "pip/_vendor/resolvelib/__init__.py"
    spec = importlib.util.spec_from_file_location(
        "_megatron_sat_resolvelib", init, submodule_search_locations=[str(init.parent)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_resolvelib = _pip_resolvelib()
BaseReporter = _resolvelib.BaseReporter
ResolutionImpossible = _resolvelib.ResolutionImpossible
Resolver = _resolvelib.Resolver
AbstractProvider = _resolvelib.AbstractProvider

ROOT = Path(__file__).resolve().parents[1]

# name -> version -> (requirements, {extra: requirements}). The GPU world (recorded metadata).
GPU_WORLD: dict[str, dict[str, tuple[list[str], dict[str, list[str]]]]] = {
    "torch": {"2.11.0": ([], {}), "2.14.1": ([], {})},
    "transformers": {"5.19.0": ([], {})},
    "sglang": {"0.5.23": (["torch==2.14.1", "transformers==5.19.0"], {})},
    "transformer-engine": {
        "2.20.2": ([], {"pytorch": ["transformer-engine-torch==2.20.2"]}),
    },
    "transformer-engine-torch": {"2.20.2": (["torch>=2.1"], {})},
    "megatron-core": {"0.19.2": (["torch", "numpy"], {})},
}


def lock_index() -> dict[str, dict[str, tuple[list[str], dict[str, list[str]]]]]:
    """Every package named in the CPU lock at the version installed here (no dependencies:
    the lock was resolved as a whole by pip when it was installed)."""
    index: dict = {}
    for line in (ROOT / "tools/requirements-cpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name = canonicalize_name(Requirement(line).name)
        index.setdefault(name, {})[importlib.metadata.version(name)] = ([], {})
    return index


def merged_index() -> dict:
    index = lock_index()
    for name, versions in GPU_WORLD.items():
        index.setdefault(canonicalize_name(name), {}).update(versions)
    return index


class Provider(AbstractProvider):
    """resolvelib provider over an in-memory metadata index; candidates are
    (name, Version, extras)."""

    def __init__(self, index: dict, environment: dict[str, str]) -> None:
        self.index, self.env = index, environment

    def identify(self, requirement_or_candidate):
        if isinstance(requirement_or_candidate, Requirement):
            return canonicalize_name(requirement_or_candidate.name)
        return requirement_or_candidate[0]

    def get_preference(self, identifier, resolutions, candidates, information, backtrack_causes):
        return sum(1 for _ in candidates[identifier])

    def find_matches(self, identifier, requirements, incompatibilities):
        reqs = list(requirements[identifier])
        extras = frozenset(e for r in reqs for e in r.extras)
        bad = {c[1] for c in incompatibilities[identifier]}
        versions = sorted((Version(v) for v in self.index.get(identifier, {})), reverse=True)
        return [
            (identifier, v, extras)
            for v in versions
            if v not in bad and all(r.specifier.contains(v, prereleases=True) for r in reqs)
        ]

    def is_satisfied_by(self, requirement, candidate):
        return requirement.specifier.contains(candidate[1], prereleases=True) and set(
            requirement.extras
        ) <= set(candidate[2])

    def get_dependencies(self, candidate):
        name, version, extras = candidate
        base, by_extra = self.index[name][str(version)]
        reqs = [Requirement(r) for r in base]
        for extra in extras:
            reqs += [Requirement(r) for r in by_extra.get(extra, [])]
        return [r for r in reqs if r.marker is None or r.marker.evaluate(self.env)]


def resolve(requirements: list[str], python: str) -> dict[str, Version]:
    """Resolve ``requirements`` over the merged index for Python ``python``; name -> version.

    Raises:
        ResolutionImpossible: on a conflict (or a package the index lacks).
    """
    env = dict(default_environment(), python_version=python, python_full_version=python + ".0")
    reqs = [Requirement(r) for r in requirements]
    reqs = [r for r in reqs if r.marker is None or r.marker.evaluate(env)]
    result = Resolver(Provider(merged_index(), env), BaseReporter()).resolve(reqs)
    return {name: cand[1] for name, cand in result.mapping.items()}


def setup_metadata(path: Path) -> dict:
    """The keyword arguments ``path`` (a setup.py) passes to ``setup()``, without running it."""
    fake = mock.MagicMock()  # stands in for setuptools (importing it here trips its distutils hack)
    with mock.patch.dict(sys.modules, {"setuptools": fake}):
        runpy.run_path(str(path), run_name="__main__")
    return fake.setup.call_args.kwargs


@pytest.mark.parametrize("python", ["3.11", "3.12"])
@pytest.mark.parametrize("extra", [None, "test", "gpu"])
def test_setup_resolves(extra, python):
    meta = setup_metadata(ROOT / "setup.py")
    requirements = list(meta["install_requires"])
    if extra is not None:
        requirements += meta["extras_require"][extra]
    pins = resolve(requirements, python)
    assert pins["torch"] in {Version("2.11.0"), Version("2.13.0"), Version("2.14.1")}
    assert ("megatron-core" in pins) == (python == "3.12")
    if extra == "gpu":
        assert pins["transformer-engine-torch"] == Version("2.20.2")


def test_gpu_extra_installs_into_the_image_torch():
    """The device image's CUDA torch 2.11 satisfies the base and the gpu extra."""
    meta = setup_metadata(ROOT / "setup.py")
    pins = resolve(
        [*meta["install_requires"], *meta["extras_require"]["gpu"], "torch==2.11.0"], "3.12"
    )
    assert pins["torch"] == Version("2.11.0")


def test_servers_are_no_extra():
    meta = setup_metadata(ROOT / "setup.py")
    named = {
        canonicalize_name(Requirement(r).name)
        for reqs in meta["extras_require"].values()
        for r in reqs
    }
    assert not named & {"sglang", "vllm"}


PREVIOUS_SETUP = """
from setuptools import setup
setup(
    name="megatron-sat",
    install_requires=["torch==2.13.0", "numpy<2.5", "transformers==5.23.0"],
    extras_require={"gpu": ["transformer-engine[pytorch]==2.20.2", "sglang==0.5.23"]},
)
"""


def test_previous_setup_conflicts(tmp_path):
    """The requirements of the setup.py before issue 13 (its torch / transformers pins and the
    gpu extra with sglang): the resolver refuses them, so this test suite would have failed."""
    (tmp_path / "setup.py").write_text(PREVIOUS_SETUP)
    meta = setup_metadata(tmp_path / "setup.py")
    resolve(meta["install_requires"], "3.12")  # the base alone was fine
    with pytest.raises(ResolutionImpossible):
        resolve([*meta["install_requires"], *meta["extras_require"]["gpu"]], "3.12")
