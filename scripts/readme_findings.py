"""Check or rewrite the README's generated findings block from the committed results.

    python scripts/readme_findings.py           # exit 1 when README.md's block differs from results/
    python scripts/readme_findings.py --write   # rewrite the block in place (after a rerun)

The block lies between ``<!-- findings:begin -->`` and ``<!-- findings:end -->``
(:func:`darts_bench.report.evidence.findings_block`); tests/test_report_evidence.py checks it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from darts_bench.artifacts import atomic_write_text
from darts_bench.report.evidence import findings_block, readme_block

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the block in README.md")
    ap.add_argument("--readme", default=str(REPO / "README.md"))
    ap.add_argument("--results", default=str(REPO / "results"))
    args = ap.parse_args(argv)
    readme = Path(args.readme)
    text = readme.read_text()
    old, new = readme_block(text), findings_block(Path(args.results))
    if old is None:
        print(f"{readme}: no findings block (add the two markers where it belongs)", file=sys.stderr)
        return 2
    if old == new:
        print(f"{readme}: findings block up to date")
        return 0
    if args.write:
        atomic_write_text(readme, text.replace("\n" + old + "\n", "\n" + new + "\n", 1))
        print(f"{readme}: findings block rewritten from {args.results}")
        return 0
    print(f"{readme}: findings block differs from {args.results} (run with --write)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
