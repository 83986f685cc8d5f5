"""Shared test set-up.

The fused unscale kernels are Triton kernels. Without a GPU they are tested in triton's interpreter, which runs them
on CPU tensors; triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before any test
module imports the kernels. With a GPU the kernels are compiled and the CUDA tests run instead (run
``TRITON_INTERPRET=1 python -m pytest -k triton`` there to run the interpreter tests too). Nothing else in the
suite uses triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
