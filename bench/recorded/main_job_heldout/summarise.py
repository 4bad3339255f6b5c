"""The held-out table of README.md's "The main job" from the runs recorded here: per validation round
(weight version 0/4/8/12), each run's value, the median and the range. ``python summarise.py [DIR]``
(default: this directory; ``two_digit_only`` for those runs)."""

import json
import statistics
import sys
from pathlib import Path

KEYS = ("val/accuracy", "val/accuracy_greedy", "val/response_clip_ratio", "val/response_length_mean")


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    runs = {}
    for run in sorted(root.glob("data_seed_*"), key=lambda p: int(p.name.rsplit("_", 1)[1])):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        runs[run.name] = {r["weight_version"]: r for r in rows if r.get("validation")}
    print("runs:", ", ".join(runs))
    for key in KEYS:
        print(key)
        for version in (0, 4, 8, 12):
            values = [rounds[version][key] for rounds in runs.values() if version in rounds]
            print(f"  v{version}: {' '.join(f'{v:.3f}' for v in values)}  median {statistics.median(values):.3f} "
                  f"range {min(values):.3f}-{max(values):.3f}")


if __name__ == "__main__":
    main()
