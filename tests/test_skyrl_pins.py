"""This package's declared requirements agree with skyrl 0.4.0's, as SkyRL's users install it.

skyrl's side is read from the installed skyrl's own metadata (``importlib.metadata``): its base
requirements and its ``skyrl-train`` and ``megatron`` extras, with their markers taken on Linux
(where SkyRL runs). Our side is read from ``pyproject.toml``: the base dependencies and the extras
meant for a SkyRL environment (``skyrl``, ``loggers``). Two requirements of one package conflict
when no version satisfies both.

The ``sampler`` and ``dev`` extras move exactly one of skyrl's pins, transformers (glm5_next; why:
docs/skyrl.md, "Install"). The test states that too,
so a second moved pin, or a new conflict in the base dependencies, fails here in CI. The fresh
install that proves the same by installing (``make test-skyrl-install``) takes too long for CI.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from skyrl_megatron_kda.integrations.skyrl import SKYRL_VERSION

ROOT = Path(__file__).resolve().parents[1]
SKYRL_EXTRAS = ("skyrl-train", "megatron")
"""skyrl's extras a Megatron user installs (megatron pulls in skyrl-train)."""
SKYRL_ENV_EXTRAS = ("skyrl", "loggers")
"""Ours, installed into a SkyRL environment with skyrl's pins kept."""
LINUX = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux",
         "platform_machine": "x86_64", "python_version": "3.12", "python_full_version": "3.12.0"}


def _applies(req: Requirement, extra: str) -> bool:
    return req.marker is None or req.marker.evaluate({**LINUX, "extra": extra})


def skyrl_requirements() -> list[Requirement]:
    """skyrl's base requirements and those of ``SKYRL_EXTRAS``, from its installed metadata."""
    reqs = [Requirement(line) for line in importlib.metadata.requires("skyrl") or []]
    return [r for r in reqs if any(_applies(r, extra) for extra in ("", *SKYRL_EXTRAS))]


def our_requirements(extras: tuple[str, ...], base: bool = True) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"]) if base else []
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [r for r in map(Requirement, lines) if _applies(r, "")]


def _candidates(spec: SpecifierSet) -> set[Version]:
    """Versions at which an intersection of intervals, if not empty, has a member: every bound
    (an inclusive bound is a member) and a version just above it (for an exclusive lower bound,
    or one that ``!=`` removes), and 0 (for sets bounded only above)."""
    found = {Version("0")}
    for s in spec:
        if s.operator == "===":
            continue
        v = Version(s.version.removesuffix(".*"))
        found |= {v, Version(".".join(map(str, v.release)) + ".0.0.0.1")}
    return found


def compatible(a: SpecifierSet, b: SpecifierSet) -> bool:
    """Whether some version satisfies both ``a`` and ``b`` (pre-releases count: a pin may name one)."""
    both = a & b
    return any(both.contains(v, prereleases=True) for v in _candidates(both))


def conflicts(ours: list[Requirement], theirs: list[Requirement]) -> list[str]:
    """One line per package that both sides require and no version satisfies."""
    def by_name(reqs: list[Requirement]) -> dict[str, SpecifierSet]:
        out: dict[str, SpecifierSet] = {}
        for r in reqs:
            name = canonicalize_name(r.name)
            out[name] = out.get(name, SpecifierSet()) & r.specifier
        return out

    mine, skyrls = by_name(ours), by_name(theirs)
    return [f"{name}: ours {mine[name]}, skyrl's {skyrls[name]}"
            for name in sorted(mine.keys() & skyrls.keys())
            if not compatible(mine[name], skyrls[name])]


def test_the_installed_skyrl_is_the_release_whose_pins_are_checked():
    assert importlib.metadata.version("skyrl") == SKYRL_VERSION
    names = {canonicalize_name(r.name) for r in skyrl_requirements()}
    assert {"transformers", "ray", "torch"} <= names  # its pins are there to be compared


def test_our_skyrl_environment_requirements_agree_with_skyrls_pins():
    assert conflicts(our_requirements(SKYRL_ENV_EXTRAS), skyrl_requirements()) == []


def test_only_transformers_moves_and_only_in_the_sampler_and_dev_extras():
    """The glm5_next extras move skyrl's transformers cap and nothing else; the docs say so."""
    for extra in ("sampler", "dev"):
        moved = conflicts(our_requirements((extra,), base=False), skyrl_requirements())
        assert [line.split(":")[0] for line in moved] == ["transformers"], (extra, moved)
    install = (ROOT / "docs/skyrl.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    for said in ("`sampler`", "`loggers`", "transformers<=5.16.1", "`make test-skyrl-install`"):
        assert said in install, said


def test_a_synthetic_conflicting_pin_is_caught():
    """Negative control: pins skyrl 0.4.0 rules out are reported, by package, naming both sides;
    ranges that overlap are not."""
    skyrl = skyrl_requirements()
    found = conflicts([Requirement("ray==2.60.0"), Requirement("torch>=2.14"),
                       Requirement("transformers>5.16.1"), Requirement("datasets>=4.1,<6"),
                       Requirement("peft")], skyrl)
    assert [line.split(":")[0] for line in found] == ["ray", "torch", "transformers"], found
    assert found[0] == "ray: ours ==2.60.0, skyrl's ==2.57.0"


def test_compatible_on_interval_edges():
    pairs = {(">5.0", "<6"): True, (">=5", "<5"): False, ("<=5.16.1", ">=5.23.0"): False,
             ("==2.*", ">=2.9,<3"): True, ("!=1.0", "==1.0"): False, (">1.0", "<=1.0"): False,
             ("~=2.2", "<2.3"): True, ("==4.0.0b28", ">=4.0.0b1"): True, ("", "==1.2"): True}
    for (a, b), want in pairs.items():
        assert compatible(SpecifierSet(a), SpecifierSet(b)) is want, (a, b)
