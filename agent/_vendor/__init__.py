"""Third-party code shipped with providerd, unmodified.

pynvml.py: NVIDIA's NVML bindings from nvidia-ml-py 13.615.71 (BSD-3-Clause, see its
header and debian/copyright). `agent.gpu` imports a system `pynvml` first and falls
back to this copy.
"""
