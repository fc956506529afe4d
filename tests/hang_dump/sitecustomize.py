"""On the GPU machine, for a process that hangs: with ``HANG_DUMP_S`` set, every Python process
started with this folder on ``PYTHONPATH`` writes all its threads' stacks to stderr after that many
seconds (and keeps running). Forked processes don't inherit the timer: spawn them."""

import faulthandler
import os

if os.environ.get("HANG_DUMP_S"):
    faulthandler.dump_traceback_later(int(os.environ["HANG_DUMP_S"]), exit=False)
