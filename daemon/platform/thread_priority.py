"""Background threads that yield the CPU to the engine: work one client asked for (compiling its
grammar) must not slow everyone's decode steps on a machine with few cores.

Linux schedules threads as tasks, so a thread's own nice value is set through its native id;
macOS gives a thread a quality-of-service class (`pthread_set_qos_class_self_np`, utility), which
the scheduler serves after the interactive threads. Advisory: where neither is possible the
thread runs at the process's priority.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

log = logging.getLogger("moed.platform")

BACKGROUND_NICE = 10  # Linux: below the engine (0), above idle (19)
_QOS_CLASS_UTILITY = 0x11  # macOS <sys/qos.h>


def lower_this_thread() -> bool:
    """Lower the calling thread's CPU priority; False where the platform would not."""
    try:
        if sys.platform.startswith("linux"):
            tid = threading.get_native_id()
            nice = os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            return True
        if sys.platform == "darwin":
            libc = ctypes.CDLL(None)
            return int(libc.pthread_set_qos_class_self_np(_QOS_CLASS_UTILITY, 0)) == 0
    except (OSError, AttributeError) as exc:
        log.debug("could not lower a background thread's priority: %s", exc)
    return False
