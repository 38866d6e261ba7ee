"""The GPU suite (``bash tests/gpu/run_all.sh``): the kernel bodies on CUDA, the daemons on a GPU."""
