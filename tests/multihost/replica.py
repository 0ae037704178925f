"""A serving replica on a host of its own: `python replica.py EXPORT_URL
SERVE_ARGS...` downloads the serving export from the object store into a new
directory in the host's private /tmp (how a model artifact reaches a host
that shares no filesystem), then runs `evstore serve --export <that
directory> SERVE_ARGS...` in this process."""
import sys
import tempfile

import fsspec

from evstore_app import cli


def main(argv):
    url, serve_args = argv[0], argv[1:]
    fs, path = fsspec.core.url_to_fs(url)
    export = tempfile.mkdtemp(prefix="export-")   # a restarted replica downloads afresh
    fs.get(path.rstrip("/") + "/", export + "/", recursive=True)
    return cli.main(["serve", "--export", export, *serve_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
