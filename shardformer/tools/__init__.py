"""Tools beside the library path: verify, plan, estimates, simulation, conformance, multi-rank testing."""
