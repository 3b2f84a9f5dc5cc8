"""Imported for its one effect, and by `batch`'s fork server only (its preload, `batch._context`): Ctrl-C ignored
in that process from this import on.

Why: the fork server takes the handlers it finds when its preload is done as the ones every worker it forks starts
with. Python's own (KeyboardInterrupt) left a window, from the fork until the worker's first line set its own, in
which a Ctrl-C (it reaches the whole process group) ended a worker with a traceback after the batch had said
"interrupted". Ignoring it from here on closes that window: a worker is born ignoring Ctrl-C, and the batch, which
handles it, stops its workers (SIGTERM).
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
