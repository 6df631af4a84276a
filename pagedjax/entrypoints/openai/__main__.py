"""`python -m pagedjax.entrypoints.openai [MODEL] [--port N] ...`: the same as `pagedjax serve`."""
from pagedjax.entrypoints.openai.api_server import main

raise SystemExit(main())
