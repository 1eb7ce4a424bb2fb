"""Models on this machine and fetching them."""
