"""The documentation pages as the docs tests read them (tests/test_docs.py, tests/test_docs_shell.py):
which pages there are, their fenced blocks, and which shell blocks run."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/LOG.md, the dated benchmark log, is not on the site (mkdocs.yml) but is checked as a page.
PAGES = sorted(["README.md", "BENCHMARKS.md", "bench/LOG.md"]
               + [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)])
FENCE = re.compile(r"^(```+|~~~+)([^\n]*)\n(.*?)^\1[ \t]*$", re.S | re.M)
# A ```bash / ```sh block with this line before its fence runs as pasted (tests/test_docs_shell.py).
RUN_MARK = "<!-- docs-test: run -->"
# Pages whose marked shell blocks serve what the page's python blocks wrote: test_docs_shell.py runs
# the python blocks first, in the same shell, and test_docs.py does not run them apart.
RUN_WITH_PYTHON = {"docs/guides/serving.md"}


def read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def python_blocks(text):
    return [m.group(3) for m in FENCE.finditer(text) if m.group(2).strip() == "python"]


def run_blocks(text):
    """The shell blocks marked to run (RUN_MARK on the line before the fence)."""
    return [m.group(3) for m in FENCE.finditer(text)
            if m.group(2).strip() in ("bash", "sh") and text[:m.start()].rstrip().endswith(RUN_MARK)]
