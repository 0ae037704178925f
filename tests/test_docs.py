"""The documentation holds: README.md and every page under docs/ are checked as written.

- every ```python block of a page runs: a page's blocks, joined in order, in a fresh interpreter
  (cwd the repository root, or a new temporary directory when the page says
  `<!-- docs-test: cwd=tmp -->`). ```text blocks are shown, not run; so are ```bash and ```sh
  blocks, except those marked `<!-- docs-test: run -->` on the line before the fence: those run
  as a newcomer pastes them (README.md's train / serve / query block among them) in a shell with
  the project's environment activated, on a host of their own (tests/hosts.py: the documented
  ports 8500-8502 are free and /tmp is private, so the documented /tmp paths are new), after the
  page's python blocks where they serve what those wrote (RUN_WITH_PYTHON), and what they print
  is checked against RUN_EXPECTS;
- every relative link resolves to a file of the repository, and every #anchor to a heading of
  its page (GitHub's anchors, which mkdocs.yml's `toc` slugify also produces);
- no link and no text a user reads points outside the repository (`../shared`);
- the command-line reference is what `evstore_app.cli_reference` renders from the parser;
- `mkdocs build --strict` succeeds (skipped only when MkDocs is not installed: `make test` installs it).
"""
import glob
import os
import re
import subprocess
import sys
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(["README.md", "BENCHMARKS.md"]
               + [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)])
# The dated benchmark log is kept as it was written (it names the machine's shared paths of the time).
HISTORY = "docs/history/"
FENCE = re.compile(r"^(```+|~~~+)([^\n]*)\n(.*?)^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _python_blocks(text):
    return [m.group(3) for m in FENCE.finditer(text) if m.group(2).strip() == "python"]


def _prose(text):
    """The page without its fenced blocks and inline code (where links are not links)."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def anchor(heading):
    """GitHub's anchor of a heading: inline markup dropped, lower case, punctuation other than
    '-' and '_' dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page):
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", _read(page)), re.M):
        a = anchor(heading)
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def _links(page):
    return LINK.findall(_prose(_read(page)))


def _run_blocks(text):
    """The shell blocks marked to run (RUN_MARK on the line before the fence)."""
    return [m.group(3) for m in FENCE.finditer(text)
            if m.group(2).strip() in ("bash", "sh") and text[:m.start()].rstrip().endswith(RUN_MARK)]


RUN_MARK = "<!-- docs-test: run -->"
# What each page's marked shell blocks must print (regexes over stdout + stderr), and what the test
# does after them before it stops their background servers (README: wait until the server serves
# the newest commit of the resumed run, so the log shows it applied).
RUN_EXPECTS = {
    "README.md": [
        r"serve it with: evstore serve --export /tmp/ml/export --checkpoints /tmp/ml/ckpt --model_name movielens",
        r'\{"predictions":\[\[0\.\d+\]\]\}',
        r"evstore train: resuming at row 20,000 of 30,000",
        r"applied delta \d+ \(chain of full \d+\) in \d+\.\d+ s: [\d,]+ rows upserted, [\d,]+ deleted",
    ],
    "docs/guides/serving.md": [
        r'\{"model_version_status":\[\{"version":"2","state":"AVAILABLE"',
        r'\{"predictions":\[\[0\.\d+\],\[0\.\d+\]\]\}',
        r'\{"outputs":\[\[0\.\d+\],\[0\.\d+\]\]\}',
        r'\{"results":\[\[\["",0\.\d+\]\]\]\}',
        r'"method_name":"tensorflow/serving/classify"',
        r"evstore_serving_applied_sequence 2\.0\n",
    ],
}
# Pages whose marked shell blocks serve what the page's python blocks wrote: the python blocks run
# first, in the same shell (and not in test_python_blocks_of_the_page_run_as_written).
RUN_WITH_PYTHON = {"docs/guides/serving.md"}
RUN_AFTER = {
    "README.md": r"""
newest=$(ls /tmp/ml/ckpt | sed -n 's/^\(full\|delta\)-0*\([0-9][0-9]*\)$/\2/p' | sort -n | tail -1)
for i in $(seq 240); do
  curl -s localhost:8501/v1/models/movielens | grep -q "\"version\":\"$newest\",\"state\":\"AVAILABLE\"" && break
  sleep 0.5
done
""",
}
# The shell a newcomer pastes into, on a host of its own (tests/hosts.py): the environment as a
# user's shell has it, the page's python blocks, its marked shell blocks, RUN_AFTER, then the
# background servers the blocks started are stopped.
SHELL = """
unset TF_CPP_MIN_LOG_LEVEL PYTHONPATH PYTHONDONTWRITEBYTECODE
export PATH="$DOCS_VENV/bin:$PATH" VIRTUAL_ENV="$DOCS_VENV"
cd "$DOCS_ROOT"
if [ -n "$DOCS_PY" ]; then python -c "$DOCS_PY" || exit 98; fi
eval "$DOCS_SH"
eval "$DOCS_AFTER"
servers=$(jobs -p)
[ -n "$servers" ] && kill $servers
wait
exit 0
"""


@pytest.mark.parametrize("page", [p for p in PAGES if _run_blocks(_read(p))])
def test_shell_blocks_marked_run_work_as_pasted(page, tmp_path):
    import hosts

    assert page in RUN_EXPECTS, f"{page} has blocks marked to run: say in RUN_EXPECTS what they print"
    text = _read(page)
    env = dict(DOCS_VENV=os.path.dirname(os.path.dirname(sys.executable)), DOCS_ROOT=ROOT,
               DOCS_PY="\n".join(_python_blocks(text)) if page in RUN_WITH_PYTHON else "",
               DOCS_SH="\n".join(_run_blocks(text)),
               DOCS_AFTER=RUN_AFTER.get(page, ""))
    with hosts.network_or_skip(tmp_path / "hosts") as net:
        p = net.host("newcomer").popen(["bash", "-c", SHELL], env=env, stderr=subprocess.PIPE)
        try:
            stdout, stderr = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            raise AssertionError(f"{page}: still running after 900 s\n{stdout[-3000:]}\n{stderr[-5000:]}")
    out = stdout + stderr
    assert p.returncode == 0, f"{page}: exit {p.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    assert "Traceback" not in out, f"{page}\n{stderr[-5000:]}"
    missing = [x for x in RUN_EXPECTS[page] if not re.search(x, out)]
    assert missing == [], f"{page}: not printed: {missing}\n{stdout[-3000:]}\n{stderr[-5000:]}"


@pytest.mark.parametrize("page", [p for p in PAGES if _python_blocks(_read(p)) and p not in RUN_WITH_PYTHON])
def test_python_blocks_of_the_page_run_as_written(page, tmp_path):
    text = _read(page)
    script = tmp_path / "page_blocks.py"
    script.write_text("\n".join(_python_blocks(text)))
    cwd = tmp_path / "cwd" if "<!-- docs-test: cwd=tmp -->" in text else ROOT
    os.makedirs(cwd, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{page}: its python blocks failed\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_of_the_page_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):       # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        path = urllib.parse.unquote(path)
        dest = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        if os.path.relpath(dest, ROOT).startswith(".."):
            broken.append(f"{target}: outside the repository")
        elif not os.path.exists(dest):
            broken.append(f"{target}: no such file")
        elif frag and dest.endswith(".md") and frag not in _anchors(os.path.relpath(dest, ROOT)):
            broken.append(f"{target}: no heading with anchor #{frag}")
    assert broken == [], f"{page}: " + "; ".join(broken)


@pytest.mark.parametrize("page", [p for p in PAGES if not p.startswith(HISTORY)])
def test_the_page_points_nowhere_outside_the_repository(page):
    text = _read(page)
    assert "../shared" not in text, f"{page} names ../shared, which a clone does not have"
    assert "DESIGN.md" not in text and "DESIGN section" not in text, f"{page} cites a design file not shipped"


def test_readme_links_into_the_docs_site():
    targets = {t.partition("#")[0] for t in _links("README.md")}
    for page in ("docs/getting-started.md", "docs/guides/serving.md", "docs/reference/checkpoint-format.md",
                 "docs/reference/cli.md", "docs/performance.md"):
        assert page in targets, f"README.md does not link to {page}"


def test_benchmarks_md_holds_no_relative_links():
    """The site includes BENCHMARKS.md into docs/performance.md, where a relative link or image would
    resolve against docs/ instead of the root: BENCHMARKS.md names paths in code spans instead."""
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)", _prose(_read("BENCHMARKS.md")))
    relative = [t for t in _links("BENCHMARKS.md") + images if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", t, re.I)]
    assert relative == []


def test_checkpoint_tensor_names_are_tabled_once():
    """The per-EV tensor names have one table, docs/reference/checkpoint-format.md; other pages link to it."""
    tables = [p for p in PAGES if re.search(r"^\| *`<name>-keys_filtered`", _read(p), re.M)]
    assert tables == ["docs/reference/checkpoint-format.md"]


def test_cli_reference_page_is_rendered_from_the_parser():
    from evstore_app.cli_reference import render
    assert _read("docs/reference/cli.md") == render(), \
        "docs/reference/cli.md is stale: run `make cli-docs` (python -m evstore_app.cli_reference)"


def test_every_docs_page_is_in_the_site_nav():
    lines = [line for line in _read("mkdocs.yml").splitlines() if not line.lstrip().startswith("#")]
    nav = set(re.findall(r":\s*([\w./-]+\.md)\s*$", "\n".join(lines), re.M))
    pages = {os.path.relpath(p, "docs") for p in PAGES if p.startswith("docs/")}
    assert sorted(pages - nav) == [] and sorted(nav - pages) == []


def test_mkdocs_builds_the_site_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="MkDocs is not installed (pip install --group docs; make test installs it)")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install --group docs)")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "checkpoint-format" / "index.html").exists()
