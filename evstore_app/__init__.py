"""evstore_app: the application on top of the evstore library.

The `evstore` command (cli; `python -m evstore_app`), the parameter-server task
entry and local launcher (cluster) and the streaming job (job). It imports the
three library packages, serving_loader -> checkpoint -> evstore; none of them
imports it (docs/ARCHITECTURE.md, "Layout"; the contract is checked by
import-linter, see pyproject.toml [tool.importlinter]).
"""
