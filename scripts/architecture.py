"""Print the architecture figures over src/corral (`tests/support/architecture.py`
measures them) and what breaks each; exit 1 when any is over its bound.
Usage: python scripts/architecture.py [--json]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.architecture import measure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    figs = measure()
    if parser.parse_args().json:
        print(json.dumps(vars(figs), indent=2))
    else:
        for key, value in vars(figs).items():
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"    {item}")
    failing = figs.failures()
    print("every figure holds" if not failing else f"over bound: {', '.join(failing)}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
