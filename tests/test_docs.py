"""The documentation holds: README.md and every page under docs/ are checked as written.

- every ```python block of a page runs: a page's blocks, joined in order, in a fresh interpreter
  (cwd the repository root, or a new temporary directory when the page says
  `<!-- docs-test: cwd=tmp -->`), except on pages whose shell blocks serve what their python
  blocks wrote (docs_pages.RUN_WITH_PYTHON: tests/test_docs_shell.py runs both). ```text, ```bash
  and ```sh blocks are shown, not run, except shell blocks marked `<!-- docs-test: run -->`, which
  tests/test_docs_shell.py runs as pasted;
- a python block that opens with imports binds every name it uses, so it runs pasted on its own;
- every relative link resolves to a file of the repository, and every #anchor to a heading of
  its page (GitHub's anchors, which mkdocs.yml's `toc` slugify also produces);
- no link and no text a user reads points outside the repository (`../shared`);
- the command-line reference is what `evstore_app.cli_reference` renders from the parser;
- `mkdocs build --strict` succeeds (skipped only when MkDocs is not installed: `make test` installs it).
"""
import os
import re
import subprocess
import sys
import urllib.parse

import pytest

from docs_pages import FENCE, PAGES, ROOT, RUN_WITH_PYTHON, python_blocks, read

LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


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
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", read(page)), re.M):
        a = anchor(heading)
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def _links(page):
    return LINK.findall(_prose(read(page)))


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(read(p)) and p not in RUN_WITH_PYTHON])
def test_python_blocks_of_the_page_run_as_written(page, tmp_path):
    text = read(page)
    script = tmp_path / "page_blocks.py"
    script.write_text("\n".join(python_blocks(text)))
    cwd = tmp_path / "cwd" if "<!-- docs-test: cwd=tmp -->" in text else ROOT
    os.makedirs(cwd, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{page}: its python blocks failed\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


def _opens_with_imports(code):
    first = next((ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
    return first.startswith(("import ", "from "))


def _unbound_names(code):
    """Names `code` reads that it neither assigns nor imports and that are not builtins (symtable:
    module-level reads, and the globals its functions and comprehensions read)."""
    import builtins
    import symtable

    top = symtable.symtable(code, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    read_, todo = set(), [top]
    while todo:
        t = todo.pop()
        read_ |= {s.get_name() for s in t.get_symbols()
                  if s.is_referenced() and (not (s.is_assigned() or s.is_imported()) if t is top else s.is_global())}
        todo += t.get_children()
    return sorted(n for n in read_ - bound if not hasattr(builtins, n))


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(read(p))])
def test_a_python_block_that_opens_with_imports_runs_on_its_own(page):
    """A block that opens with imports is one a reader pastes alone: every name it uses is bound in it
    (the page's blocks also run joined, where an earlier block's imports would hide a missing one)."""
    missing = {i: _unbound_names(b) for i, b in enumerate(python_blocks(read(page))) if _opens_with_imports(b)}
    assert {i: m for i, m in missing.items() if m} == {}, f"{page}: python block(s) use names they never bind"


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


@pytest.mark.parametrize("page", PAGES)
def test_the_page_points_nowhere_outside_the_repository(page):
    text = read(page)
    assert "../shared" not in text, f"{page} names ../shared, which a clone does not have"
    machine = re.findall(r"(?<![\w.<>-])/(?:work|root|home)/[\w./-]+", text)
    assert machine == [], f"{page} names paths of one machine: {machine[:5]}"
    assert "DESIGN.md" not in text and "DESIGN section" not in text, f"{page} cites a design file not shipped"


def test_readme_links_into_the_docs_site():
    targets = {t.partition("#")[0] for t in _links("README.md")}
    for page in ("docs/getting-started.md", "docs/guides/serving.md", "docs/reference/checkpoint-format.md",
                 "docs/reference/cli.md", "docs/performance.md"):
        assert page in targets, f"README.md does not link to {page}"


def test_benchmarks_md_holds_no_relative_links():
    """The site includes BENCHMARKS.md into docs/performance.md, where a relative link or image would
    resolve against docs/ instead of the root: BENCHMARKS.md names paths in code spans instead."""
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)", _prose(read("BENCHMARKS.md")))
    relative = [t for t in _links("BENCHMARKS.md") + images if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", t, re.I)]
    assert relative == []


def test_checkpoint_tensor_names_are_tabled_once():
    """The per-EV tensor names have one table, docs/reference/checkpoint-format.md; other pages link to it."""
    tables = [p for p in PAGES if re.search(r"^\| *`<name>-keys_filtered`", read(p), re.M)]
    assert tables == ["docs/reference/checkpoint-format.md"]


def test_cli_reference_page_is_rendered_from_the_parser():
    from evstore_app.cli_reference import render
    assert read("docs/reference/cli.md") == render(), \
        "docs/reference/cli.md is stale: run `make cli-docs` (python -m evstore_app.cli_reference)"


def test_every_docs_page_is_in_the_site_nav():
    lines = [line for line in read("mkdocs.yml").splitlines() if not line.lstrip().startswith("#")]
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
