"""One module per CLI verb: ``pipeline <verb>`` lives in ``pipeline/commands/<verb>.py``.

Each module exposes ``register(subparsers)``, which adds the verb's parser and
sets ``handler`` on it. Modules import nothing heavy at import time (the stage
code is imported inside the handlers), so ``pipeline --help`` stays fast. A
handler parses options into the stage's config, calls one stage function and
prints the result with :func:`pipeline.clikit.emit`; the work itself lives in the
stage packages (``pipeline/lake``, ``pipeline/admission``, ...).
"""

from pipeline.clikit import VERBS

__all__ = ["VERBS"]   # the verbs, in ``pipeline --help`` order (declared with the helpers every verb shares)
