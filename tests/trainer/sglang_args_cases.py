"""Run with the SGLang venv's Python (test_served.py does; not a test module: it imports SGLang): parses each
command line of a JSON list with SGLang's own server argument parser (``ServerArgs.add_cli_args`` and
``ServerArgs.from_cli_args``, as ``launch_server`` does) and writes the fields the evaluation sets, one object per
command line (``{"error": ...}`` where the parser refuses it).

    python sglang_args_cases.py COMMANDS.json OUT.json

Only the parse: ``ServerArgs.__post_init__``'s checks ask for an accelerator, which the CPU has not."""

import argparse
import contextlib
import io
import json
import sys

import sglang
from sglang.srt.server_args import ServerArgs

FIELDS = (
    "model_path", "host", "port", "quantization", "speculative_algorithm", "speculative_draft_model_path",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "speculative_draft_model_quantization", "mem_fraction_static",
)  # fmt: skip


def parse(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="launch_server")
    ServerArgs.add_cli_args(parser)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = ServerArgs.from_cli_args(parser.parse_args(argv))
    except SystemExit:
        return {"error": errors.getvalue()}
    return {name: getattr(args, name) for name in FIELDS}


def main(commands: str, out: str) -> None:
    ServerArgs.__post_init__ = lambda self: None  # the parse is under test, not the checks needing a GPU
    parsed = [parse(argv) for argv in json.loads(open(commands).read())]
    with open(out, "w") as f:
        json.dump({"version": sglang.__version__, "parsed": parsed}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
