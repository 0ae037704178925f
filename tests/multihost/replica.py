"""A serving replica on a host of its own: `python replica.py EXPORT_URL
SERVE_ARGS...` downloads the serving export from the object store into the
host's private /tmp/export (how a model artifact reaches a host that shares
no filesystem), then runs `evstore serve --export /tmp/export SERVE_ARGS...`
in this process."""
import sys

import fsspec

from evstore_app import cli


def main(argv):
    url, serve_args = argv[0], argv[1:]
    fs, path = fsspec.core.url_to_fs(url)
    fs.get(path.rstrip("/") + "/", "/tmp/export/", recursive=True)
    return cli.main(["serve", "--export", "/tmp/export", *serve_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
