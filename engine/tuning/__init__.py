"""What this machine costs: measured once, cached, read on the request path (verify cost curve, batch surface, attention crossover, prefill chunk) and the draft length they imply."""
