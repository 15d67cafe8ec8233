"""Where the suite's time goes: pytest's JUnit XML read per test and per file, and two runs side by side.

    .venv/bin/python -m pytest --junitxml=/tmp/suite.xml              # (make test writes none by itself)
    .venv/bin/python bench/suite_time.py /tmp/suite.xml [--top 10] [--out bench/results/suite/after.json]
    .venv/bin/python bench/suite_time.py AFTER.xml --before BEFORE.xml --top 10
    .venv/bin/python bench/suite_time.py FULL.xml --durations tests/durations.json     # after a full run
    XBRIDGE_TEST_JUNIT=/tmp/run make test; .venv/bin/python bench/suite_time.py /tmp/run-*.xml --durations ...

Prints the total, the time per file (tests, seconds, share) and the N slowest tests; with --before, each of the
before run's N slowest tests beside its time after (or "gone": its behaviour moved to the test named in its
commit). --durations writes each test's seconds for tests/conftest.py, which marks a test measured over 2 s as
slow (make test-fast leaves it out) and hands the workers of make test the longest tests first. A test's time is
pytest's own (setup, call and teardown; JUnit's `time` attribute), so the sum is below the wall time by pytest's
collection and start; under pytest-xdist it is the sum over the workers. Writes the figures as JSON (--out) with
the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import describe  # noqa: E402


def read(path: Path) -> dict[str, dict]:
    """Every test case of a JUnit file: its node id (file::name), seconds and outcome."""
    cases: dict[str, dict] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = f"{module}.py::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        cases[name] = {"s": float(case.get("time") or 0.0), "outcome": outcome}
    return cases


def per_file(cases: dict[str, dict]) -> list[tuple[str, int, float]]:
    files: dict[str, list[float]] = defaultdict(list)
    for name, case in cases.items():
        files[name.split("::")[0]].append(case["s"])
    return sorted(((f, len(t), sum(t)) for f, t in files.items()), key=lambda row: -row[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", type=Path, nargs="+", help="one run's JUnit XML files (make test writes one a phase)")
    parser.add_argument("--before", type=Path, help="an earlier run's JUnit XML, compared test by test")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--durations", type=Path, help="write {test id: seconds} here (tests/durations.json)")
    args = parser.parse_args()
    cases = {name: case for path in args.xml for name, case in read(path).items()}
    total = sum(c["s"] for c in cases.values())
    outcomes: dict[str, int] = defaultdict(int)
    for case in cases.values():
        outcomes[case["outcome"]] += 1
    print(f"{' '.join(map(str, args.xml))}: {len(cases)} tests, {total:.0f} s ({total / 60:.1f} min) in the tests; "
          + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())))
    print(f"\n{'file':44s} {'tests':>5s} {'s':>7s} {'share':>6s}")
    files = per_file(cases)
    for name, count, seconds in files:
        print(f"{name:44s} {count:5d} {seconds:7.1f} {100 * seconds / total:5.1f}%")
    slowest = sorted(cases.items(), key=lambda item: -item[1]["s"])[:args.top]
    print(f"\nthe {args.top} slowest tests")
    for name, case in slowest:
        print(f"{case['s']:7.1f}  {name}")
    result: dict = {"machine": describe(), "xml": [str(path) for path in args.xml], "tests": len(cases),
                    "total_s": round(total, 1),
                    "outcomes": dict(outcomes),
                    "files": [{"file": f, "tests": n, "s": round(s, 1)} for f, n, s in files],
                    "slowest": [{"test": n, "s": round(c["s"], 1)} for n, c in slowest]}
    if args.before is not None:
        before = read(args.before)
        was = sum(c["s"] for c in before.values())
        print(f"\nbefore: {len(before)} tests, {was:.0f} s; after: {len(cases)} tests, {total:.0f} s "
              f"({total / was:.2f}x)")
        print(f"\nthe {args.top} slowest tests before, and after")
        rows = []
        for name, case in sorted(before.items(), key=lambda item: -item[1]["s"])[:args.top]:
            after = cases.get(name)
            rows.append({"test": name, "before_s": round(case["s"], 1),
                         "after_s": None if after is None else round(after["s"], 1)})
            shown = "gone" if after is None else f"{after['s']:7.1f}"
            print(f"{case['s']:7.1f} -> {shown:>7s}  {name}")
        result["before"] = {"xml": str(args.before), "tests": len(before), "total_s": round(was, 1),
                            "slowest_then_now": rows}
    if args.durations is not None:
        args.durations.write_text(json.dumps({n: round(c["s"], 2) for n, c in sorted(cases.items())}, indent=0)
                                  + "\n")
        print(f"\nwrote {args.durations} ({len(cases)} tests)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
