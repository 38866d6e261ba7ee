"""Reading the container image recipes of ``deploy/`` for the deploy tests: a Dockerfile as build
stages of instructions (continuation lines joined, ``ARG`` defaults expanded the way ``docker
build`` expands them without ``--build-arg``), the constraints files the recipes install with, and
which recipe builds which image tag (the README's ``docker build`` commands)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import deploy_manifests as dm

README = dm.REPO / "README.md"
_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


@dataclass
class Stage:
    """One ``FROM`` of a Dockerfile: its base (ARGs expanded), its name, its instructions."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, rest of the line)
    args: dict[str, str] = field(default_factory=dict)  # ARG defaults in scope, global ones included

    def all(self, keyword: str) -> list[str]:
        return [text for kw, text in self.instructions if kw == keyword]

    def expand(self, text: str) -> str:
        """``$NAME`` and ``${NAME}`` of this stage's ARGs replaced by their defaults."""
        return _VAR.sub(lambda m: self.args.get(m.group(1) or m.group(2), m.group(0)), text)

    def env(self) -> dict[str, str]:
        """The stage's ``ENV`` pairs, as written."""
        env: dict[str, str] = {}
        for text in self.all("ENV"):
            for pair in shlex.split(text):
                name, _, value = pair.partition("=")
                env[name] = value
        return env


def _lines(path: Path) -> list[str]:
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        current += stripped.removesuffix("\\").rstrip() + " "
        if not stripped.endswith("\\"):
            lines.append(current.strip())
            current = ""
    if current:
        raise ValueError(f"{path}: the last instruction ends with a line continuation")
    return lines


def stages(path: Path) -> list[Stage]:
    """The build stages of the Dockerfile at ``path``, in order."""
    global_args: dict[str, str] = {}
    out: list[Stage] = []
    for line in _lines(path):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            default = default.strip().strip('"')
            if out:
                scope = out[-1].args
                scope[name.strip()] = out[-1].expand(default) if default else global_args.get(name.strip(), "")
            else:
                global_args[name.strip()] = default
            continue
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            base = _VAR.sub(lambda m: global_args.get(m.group(1) or m.group(2), m.group(0)), words[0])
            out.append(Stage(base=base, name=name))
            continue
        if not out:
            raise ValueError(f"{path}: {keyword} before the first FROM")
        out[-1].instructions.append((keyword, rest))
    return out


def stage(path: Path, name: str | None) -> Stage:
    """The stage called ``name`` (None: the final one)."""
    found = stages(path)
    if name is None:
        return found[-1]
    matches = [s for s in found if s.name == name]
    if len(matches) != 1:
        raise KeyError(f"{path}: expected one stage {name!r}, stages: {[s.name for s in found]}")
    return matches[0]


def constraints(path: Path) -> dict[str, str]:
    """A pip constraints file as normalized name -> pinned version; ValueError for a line that is
    not ``name==version``."""
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)", line)
        if not match:
            raise ValueError(f"{path}: {raw!r} is not name==version")
        pins[normalize(match.group(1))] = match.group(2)
    return pins


def normalize(name: str) -> str:
    """A distribution name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalize(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def readme_builds() -> dict[str, Path]:
    """image tag -> Dockerfile, from the README's ``docker build -f FILE -t TAG .`` commands."""
    builds: dict[str, Path] = {}
    for match in re.finditer(r"docker build -f (\S+) -t (\S+) \.", README.read_text()):
        builds[match.group(2)] = dm.REPO / match.group(1)
    return builds


def dockerfile_for(image: str) -> Path:
    """The recipe the README builds ``image`` with; KeyError naming the tags it builds."""
    builds = readme_builds()
    if image not in builds:
        raise KeyError(f"no docker build command in README.md makes {image}; it builds {sorted(builds)}")
    return builds[image]
