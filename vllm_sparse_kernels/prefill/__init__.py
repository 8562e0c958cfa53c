"""Prefill side of the kernels: the sparse attention kernel over the paged KV cache
(:mod:`.attention`: the serving kernel and the launcher; the modes only tests and benchmarks run
in :mod:`.variants`; host packing :mod:`.packing`, jit building blocks :mod:`.tiles` and launch
table :mod:`.launch_config`), the GPU index estimators (:mod:`.estimate`,
:mod:`.vs_index`) and the score arithmetic they share with the plugin's torch estimators
(:mod:`.estimate_math`, torch only).

Importing this package imports neither triton nor its modules: :mod:`.estimate_math` and
:mod:`.launch_config` must stay importable on CPU installs without triton.
"""
