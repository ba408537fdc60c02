"""Puts tests/ on sys.path for every test directory, so that tests/passes and tests/kernels can import
the shared helpers (parity, pool) however pytest is started."""
