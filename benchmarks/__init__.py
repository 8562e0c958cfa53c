"""The project's benchmarks: one script per question (see benchmarks/README.md).

Run them as modules from the repository root, ``python -m benchmarks.e2e ...``: the root is then on
sys.path (so ``benchmarks`` and the checkout's packages import plainly) and this folder is not (its
``kernels.py`` would otherwise hide the ``kernels`` package that transformers probes for).
``benchmarks.studies`` holds one-off investigations, ``benchmarks.infra`` the GPU staging tools.
Not part of the installed distribution.
"""
