"""The long fuzz run before a release (issue 35): as many cases of ``tests/fuzz`` as the minutes
allow, each in a process of its own under a memory limit and a timeout; prints the counts per
generator and outcome and the bugs (new ones, then the known ones of ``known_bugs.py``), and
saves each bug's reproducer (the model and data files, and the command that reruns the case)
under ``OUT/bugs/``. Exit status 1 where a bug is not in the known list.

    python scripts/fuzz.py --minutes 20 --seed 35 --out fuzz-out
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from fuzz import known_bugs, runner  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=35)
    p.add_argument("--out", type=Path, default=Path("fuzz-out"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--memory-gib", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=runner.TIMEOUT_S, help="seconds per case")
    args = p.parse_args(argv)
    records = runner.campaign(args.seed, args.out, workers=args.workers, minutes=args.minutes,
                              memory_bytes=int(args.memory_gib * (1 << 30)),
                              timeout=args.timeout)
    runner.write_records(records, args.out)
    print(runner.report(records, args.seed))
    seen = {r.get("known") for r in records}
    gone = sorted({item for item in known_bugs.KNOWN.values() if item not in seen})
    if gone:
        print(f"known items not met in this run (fixed, or not reached): {gone}")
    new = [r for r in records if r["outcome"] in runner.BUGS and not r.get("known")]
    print(f"records: {args.out / 'records.jsonl'}; reproducers: {args.out / 'bugs'}")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
