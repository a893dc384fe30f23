import time

started = time.perf_counter()  # before torch and ucp are imported: the resume's time to first step counts them

import os
import sys
import traceback

from ucp.errors import UcpError

from .train import main

try:
    main(started=started)
except Exception as e:  # noqa: BLE001 -- any failure ends the process the same way
    # A lost peer fails a collective here. The process must end now, without waiting for a background save or a
    # collective that can no longer complete (the interpreter's exit would join those threads), so that an elastic
    # agent can restart the group at once; the save in flight, uncommitted, is collected later.
    if isinstance(e, UcpError):  # (a checkpoint's error names its problem and path: one line, as ucp's commands)
        print(f"trainer: {type(e).__name__}: {e}", file=sys.stderr)
    else:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
