"""`python -m glm46.data.staged DIR`: the progress of the staged preparation writing DIR, per stage;
`... DIR --run STAGE INDEX`: run one of its tasks (what the local executor starts for each)."""

import argparse

from .stages import run_task
from .work import StagedPlan, progress_table

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m glm46.data.staged")
    parser.add_argument("output_dir", help="the preparation's source.output_dir")
    parser.add_argument("--run", nargs=2, metavar=("STAGE", "INDEX"), help="run this task (if not finished)")
    args = parser.parse_args()
    if args.run:
        run_task(args.output_dir, args.run[0], int(args.run[1]))
    else:
        print(progress_table(StagedPlan.load(args.output_dir)))
