"""Print a constraints file without the pins that the installed torch's own requirements exclude.

    python scripts/constraints_for_torch.py constraints.txt

constraints.txt holds the versions the suite passed with, frozen beside one torch; setup.sh keeps the torch a
machine already has (the GPU lease's device: PyPI's 2.11, which requires setuptools<82 where the freeze has 84). A
pin that torch's requirement excludes would make pip refuse the whole install, so it is left out (and said on
stderr): torch's requirement then picks that package's version.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a fresh venv before setup.sh installs packaging: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version


def torch_requirements() -> dict[str, Requirement]:
    """torch's unconditional requirements by canonical name (none without torch)."""
    try:
        specs = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        return {}
    reqs = [Requirement(s) for s in specs]
    return {canonicalize_name(r.name): r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})}


def compatible(lines: list[str], wanted: dict[str, Requirement]) -> list[str]:
    kept = []
    for line in lines:
        spec = line.split("#")[0].strip()
        if "==" in spec:
            name, version = (p.strip() for p in spec.split("==", 1))
            req = wanted.get(canonicalize_name(name))
            if req is not None and not req.specifier.contains(Version(version), prereleases=True):
                print(f"{name}=={version} left to torch's own requirement {req}", file=sys.stderr)
                continue
        kept.append(line)
    return kept


def main() -> None:
    lines = Path(sys.argv[1]).read_text().splitlines()
    print("\n".join(compatible(lines, torch_requirements())))


if __name__ == "__main__":
    main()
