"""A stand-in training script that prints what the launcher gave it: its arguments and
environment as JSON on stdout, then exits with ANYGPU_TEST_EXIT (default 0)."""

import json
import os
import sys

print(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ)}))
sys.exit(int(os.environ.get("ANYGPU_TEST_EXIT", "0")))
