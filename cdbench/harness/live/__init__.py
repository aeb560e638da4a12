"""``live`` mode's GPU side: the forward step built from a model spec, run and timed for real."""
