"""Where the benchmarks run and write: every benchmark process runs with the
repository root as its working directory (`python -m bench.<area>.<name>`), so
`bench`, `evstore`, `checkpoint`, `serving_loader` and `evstore_app` import from
the checkout without any sys.path edit."""
import os

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
RESULTS = os.path.join(BENCH, "results")      # git-ignored
LOGS = os.path.join(RESULTS, "logs")
