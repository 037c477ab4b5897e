"""Standard-library helpers shared by every k3nvfp4 package (``k3nvfp4.common``).

Importing it pulls neither torch nor triton, so the import-light modules (the SGLang plugin
entry point, the server-level A/B client) can use it.

- ``files``: atomic file writes (temporary beside the target, fsync, rename);
- ``cli``: the help formatter every command-line tool uses (defaults shown);
- ``progress``: a bar on a terminal, plain status lines at a fixed interval in a log;
- ``entry``: the console scripts' entry points (a Ctrl-C while torch imports is one line).
"""
