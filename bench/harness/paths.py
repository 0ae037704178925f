"""Where the benchmarks run and write: every benchmark process runs with the
repository root as its working directory (`python -m bench.<area>.<name>`), so
`bench`, `evstore`, `checkpoint`, `serving_loader` and `evstore_app` import from
the checkout without any sys.path edit."""
import os

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
RESULTS = os.path.join(BENCH, "results")      # git-ignored
LOGS = os.path.join(RESULTS, "logs")


def write_result(name, result):
    """Writes `result` to RESULTS/<name>.json, prints it and the path; returns the path."""
    import json
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    print(f"results: {path}")
    return path
