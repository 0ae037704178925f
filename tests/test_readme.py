"""The README's quick start runs as written (in a fresh interpreter)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_quick_start_runs_as_written(tmp_path):
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2, "README lost its quick start"
    script = tmp_path / "quickstart.py"
    script.write_text("\n".join(blocks))
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[40 20  0]" in r.stdout or "[40 20 0]" in r.stdout, r.stdout


def _anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_readme_contents_lists_every_section_with_a_working_link():
    text = open(os.path.join(ROOT, "README.md")).read()
    body = re.sub(r"```.*?```", "", text, flags=re.S)
    sections = re.findall(r"^## (.+)$", body, re.M)
    contents = body.split("## Contents", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"^- \[(.+?)\]\(#([\w\-]+)\)", contents, re.M)
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", body, re.M)}
    assert [t for t, _ in links] == [h for h in sections if h != "Contents"][1:], "Contents is out of date"
    assert [a for _, a in links if a not in anchors] == []
    for target in re.findall(r"\]\(#([\w\-]+)\)", body):
        assert target in anchors, target
