"""The benchmarks, run from the repository root as ``python -m bench.<name>``; no part of the installed product."""
