"""Print the aggregates of the synthetic workload, or of a labelled JSONL file.

    python -m gateway.lab.workload                   # generate() with the paper's 18,608 prompts
    python -m gateway.lab.workload -n 5000 --seed 1  # another size or seed
    python -m gateway.lab.workload data.jsonl        # a labelled file (e.g. the authors' release)
    python -m gateway.lab.workload --write out.jsonl # also save the generated records
"""

from __future__ import annotations

import argparse
import json
import sys

from gateway.records import read_jsonl, write_jsonl

from .summary import aggregates
from .synthetic import PAPER_SIZE, generate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.lab.workload", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", help="labelled JSONL file to summarise instead of the synthetic set")
    parser.add_argument("-n", type=int, default=PAPER_SIZE, help="synthetic records to generate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", metavar="OUT", help="write the generated records to this JSONL file")
    args = parser.parse_args(argv)
    try:
        if args.path:
            records = read_jsonl(args.path)
            source = args.path
        else:
            records = generate(args.n, args.seed)
            source = f"generate(n={args.n}, seed={args.seed})"
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.write:
        write_jsonl(records, args.write)
    print(json.dumps({"source": source, **aggregates(records)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
