"""`python -m evstore_app`: the evstore command line."""
import sys

from evstore_app.cli import main

sys.exit(main())
