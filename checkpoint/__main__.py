"""``python -m k3nvfp4.checkpoint`` = ``k3nvfp4-cast``."""

from .cli import main

raise SystemExit(main())
