"""Tools that stage models and vLLM builds on a GPU machine without network, and the vLLM worker
extension ``benchmarks.e2e`` plants its attention band with."""
