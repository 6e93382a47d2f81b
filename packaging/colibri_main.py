"""Entry point of the frozen bundle (PyInstaller): the ``colibri`` console script.

No arguments start the desktop app; arguments go to the command line (``colibri run ...``,
``colibri doctor``), exactly like the pip-installed ``colibri`` (colibri_app.launcher).
"""

import multiprocessing
import sys

from colibri_app.launcher import main

if __name__ == "__main__":
    # a spawned child of the bundle (engine.kernel_prepare compiles the kernels in one on a first
    # start) runs its target here instead of the app
    multiprocessing.freeze_support()
    sys.exit(main())
