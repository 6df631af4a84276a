"""`python -m pagedjax.server [MODEL] [--port N] ...`: the same as `pagedjax serve`."""
from pagedjax.server.cli import main

raise SystemExit(main())
