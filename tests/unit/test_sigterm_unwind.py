"""A SIGTERM whose KeyboardInterrupt is lost on its way still ends a bench's waiting loop
(txbox_tools.processes.unwind_on_sigterm)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

# In its own interpreter: pytest reports an exception raised in a callback instead of
# losing it as a plain program does.
PROGRAM = """
import gc, os, signal, weakref
from txbox_tools import processes

class Held:
    pass

processes.unwind_on_sigterm()
processes.raise_if_terminated()  # nothing yet
held = Held()
# The signal is handled inside a weakref callback: Python only reports its exception.
weakref.finalize(held, os.kill, os.getpid(), signal.SIGTERM)
del held
gc.collect()
print("went on", flush=True)
try:
    processes.raise_if_terminated()
except KeyboardInterrupt:
    print("raised again")
"""


def test_an_interrupt_lost_in_a_callback_is_raised_again_by_the_next_check() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["went", "on", "raised", "again"], done.stdout + done.stderr
    assert "KeyboardInterrupt" in done.stderr  # the first one, reported and lost
