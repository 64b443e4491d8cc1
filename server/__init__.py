"""genie_rt.server."""
