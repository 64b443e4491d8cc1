"""genie_rt.quant."""
