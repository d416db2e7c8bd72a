"""cachetier: the control-plane face of the cache tier (configuration, CLI, later service and client).

Owns configuration (`config`) and the command line. It must not touch Redis keys or pool bytes
directly: those belong to `index/` and `gpu_pool/`.
"""
