"""What `python run.py task=...` runs: the tasks (`tasks.py`), training and its restarts, the curriculum's
phases, the dataset a run prepares first, and sweeps. The top floor: it may import every other package, none
imports it."""
