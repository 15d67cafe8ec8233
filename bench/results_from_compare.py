"""Regenerate a comparison section of docs/results.md from a compare's output folder.

    python bench/results_from_compare.py out/compare-gpt            # the `make run` section
    python bench/results_from_compare.py OUT --section NAME          # another marked section

The section is the text between ``<!-- compare:NAME begin -->`` and ``<!-- compare:NAME end -->`` in the results file
(``make-run`` by default). It is replaced by the folder's ``report.md`` (written by ``xbridge compare``), its title
turned into a level-2 heading and its other headings demoted one level, so the page keeps one ``#`` title. Text
outside the markers (a reading of the figures) is left as it is. The file is written only when both markers are
found once each, in order."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def section_text(report: str) -> str:
    """``report.md`` as a section: every heading one level down (its ``#`` title becomes ``##``)."""
    lines = [("#" + line) if re.match(r"#+ ", line) else line for line in report.strip().splitlines()]
    return "\n".join(lines)


def replace_section(page: str, name: str, body: str) -> str:
    begin, end = f"<!-- compare:{name} begin -->", f"<!-- compare:{name} end -->"
    if page.count(begin) != 1 or page.count(end) != 1 or page.index(begin) > page.index(end):
        raise ValueError(f"the results file must hold '{begin}' and then '{end}', once each")
    head, rest = page.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a compare's output folder (holds report.md)")
    parser.add_argument("--section", default="make-run", help="the marked section to replace (default: make-run)")
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "results.md", help="the page to update")
    args = parser.parse_args(argv)
    report_path = args.out / "report.md"
    if not report_path.is_file():
        print(f"error: {report_path} does not exist: run `xbridge compare ... --out {args.out}` first",
              file=sys.stderr)
        return 2
    try:
        page = replace_section(args.results.read_text(encoding="utf-8"), args.section,
                               section_text(report_path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:
        print(f"error: {args.results}: {exc}", file=sys.stderr)
        return 2
    args.results.write_text(page, encoding="utf-8")
    print(f"{args.results}: section '{args.section}' replaced from {report_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
