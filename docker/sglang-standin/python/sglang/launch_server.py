"""Stand-in for ``python -m sglang.launch_server``: prints the command line it was given, as JSON, and the
environment eaglet's plugin reads, then exits 0 (the real module starts the server)."""

import json
import os
import sys

PLUGIN_ENV = ("SGLANG_PLUGINS", "EAGLET_DUMP_DIR", "EAGLET_AUX_LAYER_IDS")


def main(argv: list[str]) -> int:
    sys.stdout.write(f"sglang.launch_server args: {json.dumps(argv)}\n")
    sys.stdout.write(f"sglang.launch_server env: {json.dumps({k: os.environ.get(k) for k in PLUGIN_ENV})}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
