"""PyInstaller runtime hook of the colibri bundle (runs before the app's first import).

The engine's sources ship as plain .py files (numba's cache needs them; see colibri.spec), so
Python would write ``__pycache__`` folders into the bundle. A bundle is an installed program,
often read-only and shared: never write into it. (The build precompiles those sources into
unchecked-hash .pyc files, so nothing is lost.) numba's own cache folder is chosen by
engine/kernels/setup.py: the user cache folder, or uncached when nothing is writable.
"""

import sys

sys.dont_write_bytecode = True
