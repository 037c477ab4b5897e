"""``python -P -m k3nvfp4.demo``: see :mod:`k3nvfp4.demo.run`."""

from .run import main

raise SystemExit(main())
