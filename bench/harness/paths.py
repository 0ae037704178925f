"""Where the benchmarks run and write: every benchmark process runs with the
repository root as its working directory (`python -m bench.<area>.<name>`), so
`bench`, `evstore`, `checkpoint`, `serving_loader` and `evstore_app` import from
the checkout without any sys.path edit."""
import os

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
RESULTS = os.path.join(BENCH, "results")      # git-ignored
LOGS = os.path.join(RESULTS, "logs")


def write_result(name, result, md=None, out_dir=RESULTS):
    """The one result writer of the benchmarks: writes `result` to
    <out_dir>/<name>.json, and the markdown `md` beside it (<name>.md) when
    given; prints the markdown (without one, the JSON) and where they are;
    returns their path without extension."""
    import json
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    if md is None:
        print(json.dumps(result, indent=1))
        print(f"results: {base}.json", flush=True)
        return base
    with open(base + ".md", "w") as f:
        f.write(md)
    print("\n" + md)
    print(f"results: {os.path.relpath(base, ROOT)}.json / .md", flush=True)
    return base
