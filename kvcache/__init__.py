"""genie_rt.kvcache."""
