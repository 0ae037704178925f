"""Shell blocks of the docs run as a newcomer pastes them.

A ```bash / ```sh block marked `<!-- docs-test: run -->` on the line before its fence (README.md's
train / serve / query block among them) runs in a shell with the project's environment activated
and nothing else set (no TF_CPP_MIN_LOG_LEVEL, no PYTHONPATH), on a host of its own (tests/hosts.py:
the documented ports 8500-8502 are free and /tmp is private, so the documented /tmp paths are
new), after the page's python blocks where the shell blocks serve what those wrote
(docs_pages.RUN_WITH_PYTHON); what it prints is checked against RUN_EXPECTS, and the servers it
left running in the background are stopped.
"""
import os
import re
import subprocess
import sys

import pytest

from docs_pages import PAGES, ROOT, RUN_WITH_PYTHON, python_blocks, read, run_blocks

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


@pytest.mark.parametrize("page", [p for p in PAGES if run_blocks(read(p))])
def test_shell_blocks_marked_run_work_as_pasted(page, tmp_path):
    import hosts

    assert page in RUN_EXPECTS, f"{page} has blocks marked to run: say in RUN_EXPECTS what they print"
    text = read(page)
    env = dict(DOCS_VENV=os.path.dirname(os.path.dirname(sys.executable)), DOCS_ROOT=ROOT,
               DOCS_PY="\n".join(python_blocks(text)) if page in RUN_WITH_PYTHON else "",
               DOCS_SH="\n".join(run_blocks(text)),
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
