"""genie_rt.engine."""
