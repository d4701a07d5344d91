"""`python -m dcoco_hf ...` runs the `dcoco-hf` command line."""

from .cli.main import main

raise SystemExit(main())
