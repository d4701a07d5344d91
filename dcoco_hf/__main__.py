"""`python -m dcoco_hf ...` runs the `dcoco-hf` command line."""

from .cli import main

raise SystemExit(main())
