"""Entry point of the frozen bundle (PyInstaller): the ``colibri`` console script.

No arguments start the desktop app; arguments go to the command line (``colibri run ...``,
``colibri doctor``), exactly like the pip-installed ``colibri`` (colibri_app.launcher).
"""

import sys

from colibri_app.launcher import main

if __name__ == "__main__":
    sys.exit(main())
