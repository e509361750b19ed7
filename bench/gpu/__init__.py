"""The GPU runs: ``python -m bench.gpu.<name>`` from the repository root, on the GPU machine after install.sh."""
