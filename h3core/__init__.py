"""h3: the engine behind the `h3` command.

Importing the package is cheap and does not import torch; the modules that compute do.
"""

__version__ = "0.1.0"
