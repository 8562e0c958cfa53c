"""Modules vLLM's worker processes import by qualified name (``worker_extension_cls``).

``benchmarks.e2e`` puts this folder itself on the engines' PYTHONPATH, so its modules resolve as
top-level names there (``planted_band.PlantedBandWorker``); nothing here may share a name with an
installed package.
"""
