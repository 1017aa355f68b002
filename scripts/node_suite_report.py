"""Print docs/verification.md's node-suite table: every loaded case is included (all must
pass in CI) or excluded with its reason.  Run: python scripts/node_suite_report.py"""

import sys
from collections import defaultdict
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]  # this checkout's tr_onnx, not an installed one

from node_suite import all_cases, classify  # noqa: E402


def main() -> None:
    included, excluded = classify()
    print(f"ONNX node suite: {len(all_cases())} cases loaded; {len(included)} run and pass in "
          f"CI; {len(excluded)} excluded:\n")
    by_reason = defaultdict(list)
    for name, reason in sorted(excluded.items()):
        by_reason[reason].append(name)
    print("| reason | cases |")
    print("|---|---|")
    for reason, names in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        print(f"| {reason} | {len(names)}: {', '.join(f'`{n}`' for n in names)} |")


if __name__ == "__main__":
    main()
